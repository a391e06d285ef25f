"""Where torchside and jaxside meet: layouts, weight transfer, numerics cross-checks, CLI."""
