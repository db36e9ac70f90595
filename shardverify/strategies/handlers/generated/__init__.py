"""Handler modules generated from specs/*.yaml by `shardverify generate`; never edit by hand."""
