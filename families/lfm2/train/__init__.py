"""Training laneserve's embedded default: a byte-level BPE tokenizer, a small LFM2 target
and its DSpark drafter, from the xz-compressed English corpus (MLX: Metal, CUDA or CPU).

    python -m families.lfm2.train tokenizer --corpus C --out TOK          # BPE on the train part
    python -m families.lfm2.train corpus --corpus C --tokenizer TOK --out DATA   # train.npy, eval.npy
    python -m families.lfm2.train target --tokenizer TOK --data DATA --out RUN/target
    python -m families.lfm2.train generate --target RUN/target/model --data DATA --out GEN
    python -m families.lfm2.train drafter --target RUN/target/model --data GEN --out RUN/drafter

The trainers stop when their --minutes budget is spent, checkpoint every two minutes
and at the end (OUT/checkpoint), and continue with --resume. The learning rate warms up
and decays over --steps, or over as many steps as fit in the budget (measured on the
first steps, then kept in the checkpoint). Each invocation ends by exporting OUT/model:
the target as a Hugging Face LFM2 directory with its tokenizer, the drafter in
LiquidAI's DSpark format. `generate` has the trained target write the drafter's
training text (the drafter also trains on DATA directly, but accepts fewer drafts).

Sizes of the default (bfloat16 on disk): target 8.89M parameters, 17.8 MB; drafter
1.97M, 3.9 MB; tokenizer 0.27 MB: 22.0 MB in all, under the 24 MB budget.

On the GPU machine (one H200, 16 cores; about 9 minutes per command; measured there:
tokenizing 13 s, target 1.05M tokens/s after an 11 s compile, generation 118K tokens/s,
drafter 19 ms per step). Carry the corpus (12 MB of xz) and the tokenizer beside the
repository and tokenize there: the token arrays (53 MB) are more than a transfer
carries. Weights over 16 MiB do not come back from $OUT whole: split them.

    python -m families.lfm2.train tokenizer --corpus runs/corpus --out runs/tok   # on the CPU: 46 s
    # command 1 (about 8 minutes):
    python -m families.lfm2.train corpus --corpus runs/corpus --tokenizer runs/tok --out runs/data
    python -m families.lfm2.train target --tokenizer runs/tok --data runs/data --out runs/target \\
        --dtype bfloat16 --minutes 6 --eval-every 1000 --eval-windows 128
    python -m families.lfm2.train generate --target runs/target/model --data runs/data --out runs/gen --minutes 1.5
    # command 2 (about 6.5 minutes):
    python -m families.lfm2.train drafter --target runs/target/model --data runs/gen --out runs/drafter \\
        --dtype bfloat16 --minutes 6 --eval-every 5000

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
drafter's text, written by the target).
"""
