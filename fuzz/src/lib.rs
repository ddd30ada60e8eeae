//! Fuzz targets live in `fuzz_targets/`; this library is empty.
