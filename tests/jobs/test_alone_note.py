"""The alone note as Redis keeps it: what a worker writes, the worker taking the group over reads."""

from prefixgrove.jobs.redis_store.alone_note import AloneNote


def test_a_note_reads_back_as_written() -> None:
    note = AloneNote(index=7, delivery=4, strikes=1, blamed=2)
    assert AloneNote.decode(note.encode().encode()) == note


def test_a_note_without_strikes_and_blame_reads_as_none_of_either() -> None:
    assert AloneNote.decode(b"3:2") == AloneNote(index=3, delivery=2, strikes=0, blamed=0)
