"""Document readers: one per file format, registered by name (``tasks/readers/base.py``).

A reader turns a file's bytes into a :class:`~tasks.readers.base.ReadDocument`: the text the
factory chunks, its title, and its page and heading maps (character offsets into that text).
"""
