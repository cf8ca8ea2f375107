"""overlapkit inside the trainer frameworks that own the training loop.

One module per framework, each imported only when used and guarded by a check that
raises :class:`~overlapkit.MissingDependencyError` naming the extra that installs the
framework (as ``transformers.integrations`` guards each outside library); nothing here
is imported by ``import overlapkit``:

- :mod:`overlapkit.integrations.lightning` — PyTorch Lightning strategies
  (``pip install 'overlapkit[lightning]'``);
- :mod:`overlapkit.integrations.transformers` —
  :class:`~overlapkit.integrations.transformers.OverlapTrainer`, Hugging Face's
  ``Trainer`` with its optimizer stepped during backward
  (``pip install 'overlapkit[transformers]'``);
- :mod:`overlapkit.integrations.accelerate` —
  :func:`~overlapkit.integrations.accelerate.prepare`, called next to
  ``accelerator.prepare``: a prepared model and an overlapped optimizer that the
  ordinary Accelerate loop drives (``pip install 'overlapkit[accelerate]'``).

What an integration cannot honour (DeepSpeed, FSDP, ``torch.compile``, fp16 loss
scaling, an optimizer the framework builds in a way overlapkit cannot take over) is
refused with an :class:`~overlapkit.OverlapkitError` before the first step.

.. versionadded:: 0.3
"""
