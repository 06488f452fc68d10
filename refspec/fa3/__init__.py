"""The production wing: SGLang's FA3 backend rules over the FA3 kernel contract."""
