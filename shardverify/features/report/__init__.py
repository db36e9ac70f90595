"""Self-contained HTML reports of verify, plan, dtensor, audit and parallelize runs (`--html FILE`):
the verdict first, layouts drawn as blocks coloured by rank, a failing strategy's error drawn over
the tensor per rank, a plan over the model's graph, a DTensor run's outcomes by case."""
