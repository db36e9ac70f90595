"""What is built on the pipeline (spec -> capture -> strategies -> verify -> plan): the
completeness audit, DTensor under test, the OpInfo sweep, coverage of an op set, the explorer,
resharding, collective algorithms, DDP and shipped parallel plans checked, and the reports.
Each room here imports the pipeline and never the other way round (tests/test_layers.py)."""
