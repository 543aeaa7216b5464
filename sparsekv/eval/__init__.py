"""Evaluation: passkey, RULER, perplexity and selection recall, scored the way their papers score them.
`grid.evaluate(lm, grid.EvalConfig(...))` runs a grid of methods x budgets x lengths in one call."""
