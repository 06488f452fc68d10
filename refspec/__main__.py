from refspec.cli import main

raise SystemExit(main())
