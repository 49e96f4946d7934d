"""Measuring: the end-to-end benchmark against peers (benchmark, its prompts, worker processes, methods and
report), the cost model of one cycle, what verify budgets buy, the GPU check, load on dflash.serve, what the
batch-aware budget would choose on a roofline GPU, speed against output length, the autoregressive draft model
the speculative peers use, a drafter's acceptance under draft vocabularies of several sizes, held-out
acceptance against the answer tokens a training run has seen, one drafter-recipe ablation on the reference pair,
the per-position acceptance of every sampling rule, and how fast the target writes training answers.
`python -m dflash.bench [run | cost-model | tree-curve | gpu-check | serve | load-sim | long-context |
output-length | ar-draft | draft-vocab | learning-curve | ablation | acceptance | answers]`."""

from __future__ import annotations

import sys

from . import (ablation, acceptance, answers, ar_draft, benchmark, costmodel, draftvocab, gpucheck, learningcurve,
               loadsim, longcontext, outputlength, serve_load, treecurve)

COMMANDS = {"run": benchmark.main, "cost-model": costmodel.main, "gpu-check": gpucheck.main,
            "tree-curve": treecurve.main, "serve": serve_load.main,
            "load-sim": loadsim.main, "long-context": longcontext.main,
            "output-length": outputlength.main, "ar-draft": ar_draft.main, "draft-vocab": draftvocab.main,
            "learning-curve": learningcurve.main, "ablation": ablation.main,
            "acceptance": acceptance.main, "answers": answers.main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return benchmark.main(argv)  # `run` is the default
