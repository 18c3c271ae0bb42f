"""unispec runtime: reads artifact directories only; never imports `export` or `engines`."""
