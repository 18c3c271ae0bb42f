"""`make models`: the bundled tiny checkpoints under models/, trained on CPU from the Python standard library.

corpus.py      deterministic train / held-out split of the stdlib sources, held-out prompts
tokenizer.py   byte-level BPE trained with `tokenizers`
targets.py     Llama 3, DeepSeek-V3 (+ its MTP layer, jointly) and Gemma 4 targets (transformers classes)
drafts.py      DFlash, Eagle3 (MHA and MLA) and the Gemma 4 assistant, trained on the target's own outputs
               through the very modules the export builds (export/archs), so training and inference agree
pipeline.py    the whole run, each model cached by a hash of its recipe; model cards
"""
