"""The clip store: scan a corpus, decode with PyAV, pack clips into HDF5 shards with MPI, read them back."""
