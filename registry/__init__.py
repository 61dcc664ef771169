"""Model versions as Git LFS branches in a registry repository."""
