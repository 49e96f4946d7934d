"""The core: the speculative loop and engine, draft trees, the verify budget, sampling rules, checkpoint specs and the
leaves they stand on; its subfolders hold what loading (model_files/), training (training/) and the applications
(extras/) share. It imports neither torch nor mlx at module level, and nothing outside dflash/core/."""
