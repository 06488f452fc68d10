"""The bug zoo's machinery: probes that expose each named wrong variant, the suite-side checks,
and the runner behind ``python -m refspec mutants``.  Nothing in production imports this package."""
