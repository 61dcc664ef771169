"""Each room's benchmark job: figures beside their limit and their peer, measured in the same run.

``all`` runs them all.
"""
