"""Training laneserve's embedded default: a byte-level BPE tokenizer, a small LFM2 target
and its DSpark drafter, from the xz-compressed English corpus (MLX: Metal, CUDA or CPU).

    python -m families.lfm2.train tokenizer --corpus C --out TOK          # BPE on the train part
    python -m families.lfm2.train corpus --corpus C --tokenizer TOK --out DATA   # train.npy, eval.npy
    python -m families.lfm2.train target --tokenizer TOK --data DATA --out RUN/target
    python -m families.lfm2.train generate --target RUN/target/model --data DATA --out GEN
    python -m families.lfm2.train drafter --target RUN/target/model --data GEN --out RUN/drafter
    python -m families.lfm2.train confidence --target RUN/target/model --drafter RUN/drafter/model \
        --data GREEDY_GEN --out DRAFTER     # its confidence head refitted to greedy survival

The trainers stop when their --minutes budget is spent, checkpoint every two minutes
and at the end (OUT/checkpoint), and continue with --resume. The learning rate warms up
and decays over --steps, or over as many steps as fit in the budget (measured on the
first steps, then kept in the checkpoint). Each invocation ends by exporting OUT/model:
the target as a Hugging Face LFM2 directory with its tokenizer, the drafter in
LiquidAI's DSpark format. `generate` has the trained target write the drafter's
training text (the drafter also trains on DATA directly, but accepts fewer drafts),
with `--repetition-penalty` and `--min-p` as a checkpoint's sampling defaults write it,
and with `--served-share S` a share of its prompts cut as a user sends them (a chat
example from its start token to its reply, or a paragraph's opening after the start
token; every row keeps one length, a short prompt getting a longer continuation).
A drafter trains on from an exported one with `--init DRAFTER` (a fresh schedule),
optionally with its MLPs widened (`--intermediate N`, the new units silent at first)
or with a share of its loss taken against the target's whole distribution
(`--soft-labels S`).

Sizes of the default (bfloat16 on disk): target 8.89M parameters, 17.8 MB; drafter
3.74M, 7.5 MB; tokenizer 0.27 MB: 25.5 MB in all, under the 28 MB budget.

On the GPU machine (one H200, 16 cores; about 9 minutes per command; measured there:
tokenizing 13 s, target 1.05M tokens/s after an 11 s compile, generation 103-118K
tokens/s, the default drafter 32 ms per step of 64 rows x 64 anchors). Carry the
corpus (12 MB of xz) and the tokenizer beside the repository and tokenize there: the
token arrays (53 MB) are more than a transfer carries. Weights over 16 MiB do not come
back from $OUT whole: split them.

    python -m families.lfm2.train tokenizer --corpus runs/corpus --out runs/tok   # on the CPU: 46 s
    # command 1 (about 8 minutes):
    python -m families.lfm2.train corpus --corpus runs/corpus --tokenizer runs/tok --out runs/data
    python -m families.lfm2.train target --tokenizer runs/tok --data runs/data --out runs/target \\
        --dtype bfloat16 --minutes 6 --eval-every 1000 --eval-windows 128
    # command 2 (about 7 minutes; the shipped drafter's, in MODEL_CARD.md, ran corpus + these in 6.3):
    python -m families.lfm2.train generate --target runs/target/model --data runs/data --out runs/gen \\
        --dtype float32 --prompt-tokens 64 --new-tokens 192 --chat-share 0.3 --even-sources --minutes 1.3
    python -m families.lfm2.train drafter --target runs/target/model --data runs/gen --out runs/drafter \\
        --dtype bfloat16 --batch 64 --lr 1.5e-3 --minutes 5 --eval-every 2000

On a CPU, the whole pipeline at tiny scale (a couple of minutes):

    python -m families.lfm2.train tokenizer --corpus C --out /tmp/t/tok --vocab 512 --max-chars 2000000
    python -m families.lfm2.train corpus --corpus C --tokenizer /tmp/t/tok --out /tmp/t/data
    python -m families.lfm2.train --cpu target --shape tiny --tokenizer /tmp/t/tok --data /tmp/t/data \\
        --out /tmp/t/target --batch 8 --seq-len 128 --warmup 20 --minutes 1
    python -m families.lfm2.train --cpu generate --target /tmp/t/target/model --data /tmp/t/data --out /tmp/t/gen \\
        --sequences 256 --batch 64 --prompt-tokens 64 --new-tokens 64 --minutes 1
    python -m families.lfm2.train --cpu drafter --shape tiny --target /tmp/t/target/model --data /tmp/t/gen \\
        --out /tmp/t/drafter --batch 8 --anchors 16 --warmup 20 --minutes 1

Modules: corpus.py (sources, split, documents, tokenization), tokenizer.py (BPE),
loop.py (schedule, mixed precision, compiled step, checkpoints, budgeted loop),
target.py and drafter.py (the two trainers and their exports), generate.py (the
drafter's text, written by the target), confidence.py (the confidence head's refit).
"""
