"""The core: the speculative loop and engine, draft trees, the verify budget, sampling rules, checkpoint specs and the
leaves they stand on. It imports neither torch nor mlx at module level, and nothing outside this folder."""
