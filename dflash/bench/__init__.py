"""Measuring: the end-to-end benchmark against peers (benchmark, its prompts, worker processes, methods and
report), the cost model of one cycle, and the GPU check. `python -m dflash.bench` runs them."""
