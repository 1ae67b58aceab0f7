"""Tiny local diffusers pipelines for the torch-side tests (nothing downloaded)."""

import pytest


def tiny_pixart_pipeline(folder):
    """Saves a PixArt-Σ pipeline with a 1-layer, 16-wide T5 encoder and a 10-word tokenizer (no transformer, no VAE)
    to ``folder``; returns ``(tokenizer, encoder)``. Skips the test without torch / diffusers / transformers."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(w, -1.0) for w in "a cat dog red blue on the".split()]
    backend = tokenizers.Tokenizer(tokenizers.models.Unigram(vocab, unk_id=2))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tokenizer = transformers.T5TokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                             unk_token="<unk>", extra_ids=0)
    torch.manual_seed(0)
    encoder = transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(vocab), d_model=16, d_kv=4, d_ff=32,
                                                                num_layers=1, num_heads=2)).eval()
    diffusers.PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None,
                                  scheduler=diffusers.DPMSolverMultistepScheduler()).save_pretrained(folder)
    return tokenizer, encoder
