"""Build data/sample/sample.jsonl.gz from public-domain texts in Debian packages (commands in README.md).

    python data/sample/make_sample.py KJV_TXT DICTD_DIR OUT

KJV_TXT is the King James Bible as printed by `bible -f gen1:1-rev22:21` (one "Ge1:1 text" line per verse);
DICTD_DIR holds jargon.{index,dict.dz} and devil.{index,dict.dz}. Documents: one per Bible chapter and one per
dictionary entry, shuffled with a fixed seed so the validation split mixes all three sources.
"""
import gzip
import json
import random
import re
import sys
from pathlib import Path

BOOKS = ("Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1_Samuel 2_Samuel 1_Kings 2_Kings "
         "1_Chronicles 2_Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes Song_of_Solomon Isaiah "
         "Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah Micah Nahum Habakkuk Zephaniah Haggai "
         "Zechariah Malachi Matthew Mark Luke John Acts Romans 1_Corinthians 2_Corinthians Galatians Ephesians "
         "Philippians Colossians 1_Thessalonians 2_Thessalonians 1_Timothy 2_Timothy Titus Philemon Hebrews James "
         "1_Peter 2_Peter 1_John 2_John 3_John Jude Revelation").split()
DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"  # dictd's base-64 numbers


def bible_chapters(path: Path):
    chapters, books = {}, []
    for line in path.read_text(encoding="utf-8").splitlines():
        book, chapter, verse, text = re.fullmatch(r"(\d?[A-Za-z]+)(\d+):(\d+) (.*)", line).groups()
        if book not in books:
            books.append(book)
        chapters.setdefault((book, int(chapter)), []).append(f"{verse} {text}")
    assert len(books) == len(BOOKS), f"expected {len(BOOKS)} books, found {len(books)}"
    names = {abbrev: name.replace("_", " ") for abbrev, name in zip(books, BOOKS)}
    return [f"{names[book]} {chapter}\n\n" + "\n".join(verses) for (book, chapter), verses in chapters.items()]


def dictd_entries(directory: Path, name: str):
    data = gzip.decompress((directory / f"{name}.dict.dz").read_bytes())  # dictzip is gzip-compatible
    entries = {}
    for line in (directory / f"{name}.index").read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if headword.startswith("00"):  # dictd's own metadata entries, not dictionary text
            continue
        offset, length = (sum(DICTD_DIGITS.index(c) * 64**i for i, c in enumerate(reversed(field)))
                          for field in (offset, length))
        entries[offset] = data[offset:offset + length].decode("utf-8")  # several headwords may share one entry
    texts = [entries[offset] for offset in sorted(entries)]
    # Jargon File markup: {cross reference} braces and four-space body indentation.
    return [re.sub(r"(?m)^    ", "", re.sub(r"\{([^{}]*)\}", r"\1", text)).strip() for text in texts]


def main(kjv_txt, dictd_dir, out):
    docs = [("kjv", text) for text in bible_chapters(Path(kjv_txt))]
    docs += [(name, text) for name in ("jargon", "devil") for text in dictd_entries(Path(dictd_dir), name)]
    random.Random(0).shuffle(docs)
    lines = "".join(json.dumps({"source": source, "text": text}, ensure_ascii=False) + "\n" for source, text in docs)
    # mtime=0 and no file name in the gzip header: the same inputs give the same bytes
    Path(out).write_bytes(gzip.compress(lines.encode("utf-8"), compresslevel=9, mtime=0))
    print(f"{len(docs)} documents, {len(lines.encode()):,} bytes of JSON Lines -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
