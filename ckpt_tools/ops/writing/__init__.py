"""What every writing verb shares: carried files, dtypes and configs written, MTP written beside a carried trunk,
and the plan executed and validated."""
