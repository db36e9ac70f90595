"""The HTML reports as a reader sees them: each page written by its command's --html, rendered in
headless Chromium (Debian's package) with the network closed, its rendered text checked and a
screenshot taken and looked at (the verdict badge drawn in its colour, the drawings in the
ranks' colours). Skipped, saying why, where Chromium is not installed.

SHARDVERIFY_SCREENSHOTS=DIR keeps the screenshots in DIR (the README's come from there)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from shardverify.cli.main import main
from shardverify.features.report.draw import rank_colour

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get install "
                                                             "chromium); the pages are checked without a browser in "
                                                             "test_report_html.py")
#: headless, offline: every host name resolves nowhere, so a page that fetched anything would show it
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--host-resolver-rules=MAP * ~NOTFOUND")
PASS_GREEN, FAIL_RED = (0x1a, 0x7f, 0x37), (0xcf, 0x22, 0x2e)


def chromium(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120, check=True)


def rendered_text(page: Path, tmp_path: Path) -> str:
    """The page's DOM after Chromium loaded it."""
    return chromium(page, tmp_path, "--dump-dom").stdout


def screenshot(page: Path, tmp_path: Path, name: str, height: int = 1400) -> set[tuple[int, int, int]]:
    """The colours of a 1280-wide screenshot of ``page`` (kept as NAME.png in $SHARDVERIFY_SCREENSHOTS)."""
    shot = tmp_path / f"{name}.png"
    chromium(page, tmp_path, f"--window-size=1280,{height}", f"--screenshot={shot}")
    kept = os.environ.get("SHARDVERIFY_SCREENSHOTS")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(kept) / shot.name)
    return png_colours(shot.read_bytes())


def png_colours(data: bytes) -> set[tuple[int, int, int]]:
    """The RGB colours of an 8-bit RGB or RGBA PNG (what Chromium writes), its rows unfiltered
    by the PNG rules (none, sub, up and average rows at once, Paeth rows pixel by pixel)."""
    import numpy as np

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat = 8, b""
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour_type in (2, 6)
            step = 3 if colour_type == 2 else 4
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, width * step + 1)
    image = np.zeros((height, width * step), dtype=np.int64)
    previous = np.zeros(width * step, dtype=np.int64)
    for row in range(height):
        kind, line = rows[row, 0], rows[row, 1:].astype(np.int64)
        if kind == 1:
            line = line.reshape(width, step).cumsum(axis=0).reshape(-1) % 256
        elif kind == 2:
            line = (line + previous) % 256
        elif kind in (3, 4):   # each byte depends on the one before it: plain Python ints
            out, above = line.tolist(), previous.tolist()
            for i in range(width * step):
                left = out[i - step] if i >= step else 0
                up, corner = above[i], above[i - step] if i >= step else 0
                if kind == 3:
                    out[i] = (out[i] + (left + up) // 2) & 255
                else:
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    out[i] = (out[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
            line = np.array(out, dtype=np.int64)
        image[row], previous = line, line
    pixels = image.reshape(height, width, step)
    packed = np.unique((pixels[:, :, 0] << 16) | (pixels[:, :, 1] << 8) | pixels[:, :, 2])
    return {(int(v) >> 16, (int(v) >> 8) & 255, int(v) & 255) for v in packed}


def rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


@needs_chromium
def test_a_failing_strategy_page_draws_its_layouts_and_errors(tmp_path, monkeypatch, capsys):
    from shardverify.verify import rank

    monkeypatch.setattr(rank, "grad_hook_on_ranks", lambda ranks, action, grads: grads)   # gradient syncs lost
    page = tmp_path / "verify.html"
    assert main(["verify", "linear", "--mesh", "2,2", "--root", str(REPO), "--html", str(page)]) == 1
    capsys.readouterr()
    dom = rendered_text(page, tmp_path)
    assert "FAIL" in dom and "Failing strategies" in dom and "grad of weight" in dom
    assert 'aria-label="layout of weight"' in dom and 'aria-label="error of rank 0 in grad of weight"' in dom
    colours = screenshot(page, tmp_path, "report-verify-failure", 1800)
    assert FAIL_RED in colours and rgb(rank_colour(0)) in colours and rgb(rank_colour(3)) in colours


@needs_chromium
@pytest.mark.slow
def test_a_zoo_plan_page_draws_the_model_graph(tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert main(["plan", "zoo:gpt2", "--html", str(page)]) == 0
    capsys.readouterr()
    dom = rendered_text(page, tmp_path)
    assert "PASS" in dom and "The plan over the model" in dom and 'aria-label="the model graph"' in dom
    assert "Layouts of the sharded nodes" in dom
    colours = screenshot(page, tmp_path, "report-plan-gpt2", 1600)
    assert PASS_GREEN in colours


@needs_chromium
def test_a_dtensor_page_shows_outcomes_and_classes(tmp_path, capsys):
    page = tmp_path / "dtensor.html"
    assert main(["dtensor", "cumsum", "--mesh", "4", "--root", str(REPO), "--quiet", "--html", str(page)]) == 0
    capsys.readouterr()
    dom = rendered_text(page, tmp_path)
    assert "Outcomes by case and mesh" in dom and "cumsum forward input=S(2)" in dom and "accepted" in dom
    colours = screenshot(page, tmp_path, "report-dtensor-cumsum", 1100)
    assert PASS_GREEN in colours and FAIL_RED in colours   # the badge, and the silent class's count
