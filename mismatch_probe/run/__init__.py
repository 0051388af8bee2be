"""The run directory: versioned Parquet schema, atomic writes, the run writer and manifest."""
