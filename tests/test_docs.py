"""The documentation's relative links: every link and image in README.md and docs/ (results
included) points at a file of this checkout, and a #fragment into a Markdown file names one of
its headings. No models, no network."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the text may hold code spans (already blanked) and brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(page: Path) -> list[str]:
    """The link targets of a Markdown page, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    return LINK.findall(text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered -1, -2, ..."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE):
        heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken(page: Path) -> list[str]:
    """The relative links of a page whose file is missing, or whose #fragment names no heading."""
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            where = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file.name
            bad.append(f"{target} (no heading #{fragment} in {where})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_at_a_file_that_exists(page):
    assert broken(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section (`x=1`)\n\n## Results — [file](other.md)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#a-section-x1) ![ok](other.md) [web](https://example.com)\n"
                    "[ok](other.md#results--file)\n"
                    "[gone](missing.md) [no heading](other.md#nowhere) [self](#title)\n"
                    "`[in code](missing_too.md)`\n```\n[in a block](missing_three.md)\n```\n# Title\n")
    assert broken(page) == ["missing.md (no such file)", "other.md#nowhere (no heading #nowhere in other.md)"]


def test_the_readme_fits_on_a_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 260


def test_the_option_tables_are_the_ones_the_code_makes():
    # docs/api.md's DecoderConfig table and docs/cli.md's flag table come from the code
    # (config.HELP, cli.common.MODEL_FLAGS): regenerate them with these functions after a change
    import dataclasses

    from specdecode.cli.common import MODEL_FLAGS, flags_table
    from specdecode.config import HELP, DecoderConfig, markdown_table

    assert markdown_table() in (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert flags_table() in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    fields = {f.name for f in dataclasses.fields(DecoderConfig)}
    assert set(HELP) == fields
    api_only = {"guard_costs", "device", "offload_folder", "max_batch_size", "use_generation_config"}
    assert {field for field, _, _ in MODEL_FLAGS} == fields - api_only  # (--max-batch-size: per command)
