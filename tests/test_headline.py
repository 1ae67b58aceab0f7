"""benchmarks/results/headline.json: validation, atomic update, and the README tables rendered from it."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from kroquant_jax import headline

ROOT = Path(__file__).resolve().parent.parent
HEADLINE = ROOT / "benchmarks/results/headline.json"


def _figure(**changes):
    base = dict(value=1.5, unit="x", higher_is_better=True, device="NVIDIA H200", jax="0.11.2",
                date_utc="2026-11-30", command="python3 benchmarks/x.py", source="benchmarks/results/x.json")
    base.update(changes)
    return base


def test_readme_tables_match_headline_json():
    figures = headline.load(HEADLINE)
    text = (ROOT / "README.md").read_text()
    assert "<!-- headline:gpu -->" in text
    assert headline.render_readme(text, figures) == text, "README is stale: run python benchmarks/render_readme.py"


def test_every_figure_traces_to_an_existing_results_file():
    for key, fig in headline.load(HEADLINE).items():
        assert (ROOT / fig.source).is_file(), f"{key}: source {fig.source} does not exist"


def _numbers(source: Path) -> list[float]:
    """Every number of a results file: the numeric leaves of a JSON file, the numbers written in a text one."""
    if source.suffix == ".json":
        def leaves(x):
            if isinstance(x, dict):
                x = list(x.values())
            if isinstance(x, list):
                for v in x:
                    yield from leaves(v)
            elif isinstance(x, (int, float)) and not isinstance(x, bool):
                yield float(x)
        return list(leaves(json.loads(source.read_text())))
    return [float(t.replace(",", "")) for t in re.findall(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?",
                                                          source.read_text())]


def _mean(errors: dict) -> float:
    return sum(errors.values()) / len(errors)


def _kernel_quantizer_fraction(kernels: dict) -> float:
    """K1 quantizers + XLA's E4M3 re-encodes over the fused FP8 GEMMs (docs/w4a4.md's definition)."""
    t = kernels["top_ms"]
    return (t["tq_k1_mxfp4"] + t["tq_k1_mxfp4__1"] + t["input_concatenate_fusion_3"] + t["input_concatenate_fusion"]) \
        / t["fp8_gemm_fused_mosaic_gpu_kernel"]


def _beats_both(test: dict) -> float:
    new, h, sq = test["smoothed_kroquant new"], test["hadamard32"], test["smoothquant"]
    return sum(new[n] < h[n] and new[n] < sq[n] for n in new) / len(new)


def _dequant_layer_shapes(d: dict, m: int) -> float:
    """Layer shapes of ``w4a4_models.json`` at ``m`` with both a ``w4a4_layer_dequant`` and a ``bf16_xla`` time."""
    def timed(case, name):
        return any(v["variant"] == name and "us" in v for v in case["variants"])

    return float(sum(c["m"] == m and timed(c, "w4a4_layer_dequant") and timed(c, "bf16_xla") for c in d["cases"]))


#: The figures computed from their source's numbers rather than copied from it: ``key -> (derivation from the loaded
#: JSON source, digits the figure was rounded to or None)``. A new figure must either be a number of its source or
#: be listed here, so each one is checked against the file it cites.
DERIVED = {
    "gptq_layer_error_reduction_fraction": (
        lambda d: 1 - _mean(d["errors"]["smoothed_kroquant+gptq"]) / _mean(d["errors"]["smoothed_kroquant"]), 4),
    "gptq_layer_error_reduction_fraction_hadamard32": (
        lambda d: 1 - _mean(d["errors"]["hadamard32+gptq"]) / _mean(d["errors"]["hadamard32"]), 4),
    "ideogram4_forward_fp8_mgpu_fused_qkv_device_time_speedup_vs_bf16": (
        lambda d: d["kernels"]["bf16"]["device_ms"] / d["kernels"]["w4a4_fp8_mgpu_fused_qkv"]["device_ms"], None),
    "ideogram4_forward_fp8_mgpu_fused_qkv_quantizer_fraction_of_gemms": (
        lambda d: _kernel_quantizer_fraction(d["kernels"]["w4a4_fp8_mgpu_fused_qkv"]), None),
    "ideogram4_forward_fp8_mgpu_quantizer_fraction_of_gemms": (
        lambda d: _kernel_quantizer_fraction(d["kernels"]["w4a4_fp8_mgpu"]), None),
    "served_fp8_mgpu_minus_dequant_psnr_db_testbed": (
        lambda d: d["strategies"]["fp8_mgpu"]["vs_teacher"]["psnr_db"] - d["strategies"]["dequant"]["vs_teacher"][
            "psnr_db"], None),
    "testbed_kroquant_beats_hadamard_fraction_24layers": (
        lambda d: d["seeds"]["0"]["summary"]["new"]["beats_hadamard"] / d["seeds"]["0"]["summary"]["new"]["layers"],
        None),
    "testbed_smoothed_kroquant_beats_both_fraction_24layers": (lambda d: _beats_both(d["seeds"]["0"]["test"]), None),
    "w4a4_layer_dequant_vs_bf16_m4096_over_shapes": (lambda d: _dequant_layer_shapes(d, 4096), None),
    "w4a4_layer_dequant_vs_bf16_m512_over_shapes": (lambda d: _dequant_layer_shapes(d, 512), None),
}
#: Text sources whose figure is a ratio of two of their numbers (``key -> (numerator, denominator)``).
DERIVED_FROM_TEXT = {"flux_forward_dequant_speedup_vs_bf16": (135.40, 184.01)}


def test_every_figure_is_in_or_derived_from_its_source():
    """A careful reader can find each figure in the file it cites: a number of it (to the digits the figure keeps),
    or, for the figures of :data:`DERIVED`, computed from it as stated there."""
    unsupported = []
    for key, fig in headline.load(HEADLINE).items():
        source = ROOT / fig.source
        if key in DERIVED:
            derive, digits = DERIVED[key]
            value = derive(json.loads(source.read_text()))
            ok = (round(value, digits) == fig.value) if digits is not None else math.isclose(value, fig.value,
                                                                                             rel_tol=1e-12)
        elif key in DERIVED_FROM_TEXT:
            num, den = DERIVED_FROM_TEXT[key]
            ok = num in _numbers(source) and den in _numbers(source) and math.isclose(num / den, fig.value,
                                                                                        rel_tol=1e-12)
        else:
            text = repr(fig.value)
            digits = len(text.split(".")[1]) if "." in text and "e" not in text else 0
            tol = max(abs(fig.value) * 1e-12, 0.5 * 10 ** -digits if digits <= 6 else 0.0)
            ok = any(abs(x - fig.value) <= tol for x in _numbers(source))
        if not ok:
            unsupported.append(f"{key} = {fig.value!r} (source {fig.source})")
    assert not unsupported, "figures not found in their source:\n" + "\n".join(unsupported)


def test_every_table_key_is_present():
    figures = headline.load(HEADLINE)
    for name in headline.TABLES:
        headline.render_block(name, figures)  # raises naming the first missing key


def test_a_changed_figure_changes_the_readme():
    figures = headline.load(HEADLINE)
    text = (ROOT / "README.md").read_text()
    key = "tq_k1_us_4096x16384_fp16"
    changed = dict(figures, **{key: dataclasses.replace(figures[key], value=figures[key].value + 100)})
    assert headline.render_readme(text, changed) != text


def test_every_rendered_table_row_has_the_header_s_cell_count():
    """A ``|`` inside a cell (``w1|w3``) is escaped: each row of each block splits into as many cells as the header."""
    figures = headline.load(HEADLINE)
    for name, table in headline.TABLES.items():
        rows = [line for line in headline.render_block(name, figures).splitlines() if line.startswith("|")]
        for line in rows:
            cells = [c for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            assert len(cells) == len(table["header"]), f"block {name!r}: {line[:120]}"
    assert any("w1\\|w3" in headline.render_block(n, figures) for n in headline.TABLES)


@pytest.mark.parametrize("changes, message", [
    (dict(value=float("nan")), "finite"),
    (dict(value="3"), "finite"),
    (dict(higher_is_better="yes"), "higher_is_better"),
    (dict(unit=""), "unit"),
    (dict(source="/tmp/x.json"), "benchmarks/results"),
])
def test_malformed_records_are_refused_naming_the_key(tmp_path, changes, message):
    path = tmp_path / "headline.json"
    path.write_text(json.dumps({"my_key": _figure(**changes)}))
    with pytest.raises(headline.HeadlineError, match=f"my_key.*{message}"):
        headline.load(path)


def test_missing_and_unknown_fields_are_named(tmp_path):
    record = _figure()
    del record["device"]
    record["colour"] = "red"
    path = tmp_path / "headline.json"
    path.write_text(json.dumps({"k": record}))
    with pytest.raises(headline.HeadlineError, match=r"missing fields \['device'\].*unknown fields \['colour'\]"):
        headline.load(path)


def test_truncated_file_is_named(tmp_path):
    path = tmp_path / "headline.json"
    path.write_text('{"k": {"value": 1')
    with pytest.raises(headline.HeadlineError, match="not valid JSON"):
        headline.load(path)


def test_update_keeps_other_keys(tmp_path):
    path = tmp_path / "headline.json"
    headline.update(path, {"a": headline.Figure(**_figure(value=1.0))})
    headline.update(path, {"b": headline.Figure(**_figure(value=2.0))})
    figures = headline.load(path)
    assert {k: f.value for k, f in figures.items()} == {"a": 1.0, "b": 2.0}
    assert not list(tmp_path.glob("*.tmp*")), "no temporary file left behind"


def test_update_with_replace_prefix_drops_that_family_only(tmp_path):
    path = tmp_path / "headline.json"
    headline.update(path, {k: headline.Figure(**_figure(value=1.0)) for k in ("demo_old", "demo_kept", "other")})
    headline.update(path, {"demo_kept": headline.Figure(**_figure(value=2.0))}, replace_prefix="demo_")
    assert {k: f.value for k, f in headline.load(path).items()} == {"demo_kept": 2.0, "other": 1.0}
    with pytest.raises(headline.HeadlineError, match="keys \\['other'\\] do not have it"):
        headline.update(path, {"other": headline.Figure(**_figure(value=3.0))}, replace_prefix="demo_")
    assert headline.load(path)["other"].value == 1.0, "a refused update writes nothing"


def test_unmatched_marker_is_an_error():
    with pytest.raises(headline.HeadlineError, match="markers do not match"):
        headline.render_readme("<!-- headline:gpu -->\nx\n", {})


@pytest.mark.parametrize("spoil", ["<!-- headline:gpu --> \n", "<!-- headline:gpu -->\r\n"])
def test_a_stale_block_is_found_whatever_its_marker_line_ends_with(spoil):
    """An opening marker with a trailing space or a CRLF ending left its block as it was, so a stale figure in it
    passed `render_readme.py --check`: such a block is regenerated now (and the check sees the difference)."""
    figures = headline.load(HEADLINE)
    text = (ROOT / "README.md").read_text()
    stale = text.replace("<!-- headline:gpu -->\n", spoil).replace("| what | measured | goal | page |", "| stale |")
    assert "| stale |" in stale
    assert headline.render_readme(stale, figures) == text


def test_a_block_that_cannot_be_rendered_or_is_missing_is_an_error():
    figures = headline.load(HEADLINE)
    text = (ROOT / "README.md").read_text()
    with pytest.raises(headline.HeadlineError, match=r"\['gpu'\]: the opening marker must end its line"):
        headline.render_readme(text.replace("<!-- headline:gpu -->\n", "<!-- headline:gpu --> note\n"), figures)
    start, end = text.index("<!-- headline:gpu -->"), text.index("<!-- /headline:gpu -->")
    without = text[:start] + text[end + len("<!-- /headline:gpu -->"):]
    with pytest.raises(headline.HeadlineError, match=r"missing \['gpu'\]"):
        headline.render_readme(without, figures)


def test_a_figure_shown_in_another_unit_than_recorded_is_an_error():
    figures = headline.load(HEADLINE)
    key = "tq_k1_us_4096x16384_fp16"  # shown as "{...:.0f} µs"
    headline.render_block("gpu", figures)
    in_ms = dict(figures, **{key: dataclasses.replace(figures[key], unit="ms", value=0.147)})
    with pytest.raises(headline.HeadlineError, match=f"shows headline key '{key}' in 'us', but it is recorded in 'ms'"):
        headline.render_block("gpu", in_ms)


def test_missing_key_is_named():
    with pytest.raises(headline.HeadlineError, match="needs headline key 'tq_k1_us_4096x16384_fp16'"):
        headline.render_block("gpu", {})


def test_checked_source_needs_out_under_benchmarks_results(tmp_path):
    """--headline without --out, or with --out outside benchmarks/results/, is a parser error (exit 2); inside, the
    source is --out relative to the repository; without --headline nothing is checked."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    headline.add_arguments(parser, "some keys", "a command")
    repo = tmp_path
    for argv in (["--headline", "h.json"], ["--headline", "h.json", "--out", str(tmp_path / "x.json")]):
        with pytest.raises(SystemExit) as exit_info:
            headline.checked_source(parser, parser.parse_args(argv), repo)
        assert exit_info.value.code == 2
    inside = str(tmp_path / "benchmarks" / "results" / "x.json")
    args = parser.parse_args(["--headline", "h.json", "--out", inside])
    assert headline.checked_source(parser, args, repo) == "benchmarks/results/x.json"
    assert args.command == "a command" and args.device is None
    assert headline.checked_source(parser, parser.parse_args(["--out", "anywhere.json"]), repo) is None
