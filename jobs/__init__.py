"""The jobs users submit; each module is also a runnable job script."""
