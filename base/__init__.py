"""What every room stands on: the user's-mistake error, atomic files and hashing, logs and progress.

It imports no other room, so any room may import it (see the README's code map).
"""
