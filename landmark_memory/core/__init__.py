"""Leaf utilities every layer above may use, importing nothing of the package: names the
command line offers, crash-safe files, the C heap's free pages given back, Numba's compile
switch, the landmark layout of a sequence, RoPE, int8 blocks, the bundled tokenizer,
greedy/sampled decoding, passkey prompts, the options a question is answered by."""
