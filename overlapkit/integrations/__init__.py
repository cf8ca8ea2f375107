"""overlapkit inside the trainer frameworks that own the training loop.

One module per framework, each imported only when used and guarded by a check that
raises :class:`~overlapkit.MissingDependencyError` naming the extra that installs the
framework; nothing here is imported by ``import overlapkit``:

- :mod:`overlapkit.integrations.lightning` — PyTorch Lightning strategies
  (``pip install 'overlapkit[lightning]'``).

.. versionadded:: 0.3
"""
