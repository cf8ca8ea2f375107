"""overlapkit inside the trainer frameworks people use: one module per framework.

- :mod:`overlapkit.integrations.accelerate`: :func:`~overlapkit.integrations.accelerate.prepare`,
  called next to ``accelerator.prepare``: a prepared model and an overlapped optimizer
  that the ordinary Accelerate loop drives (``pip install 'overlapkit[accelerate]'``);
- :mod:`overlapkit.integrations.transformers`:
  :class:`~overlapkit.integrations.transformers.OverlapTrainer`, Hugging Face's
  ``Trainer`` with its optimizer stepped during backward
  (``pip install 'overlapkit[transformers]'``).

Nothing is imported here: each module imports its framework when it is imported, and
raises :class:`~overlapkit.errors.MissingExtraError` naming the extra to install when
the framework is missing (as ``transformers.integrations`` guards each outside library).
What an integration cannot honour (DeepSpeed, FSDP, ``torch.compile``, fp16 loss
scaling, an optimizer the framework builds in a way overlapkit cannot take over) is
refused with an :class:`~overlapkit.errors.OverlapkitError` before the first step.

.. versionadded:: 0.3
"""

from __future__ import annotations
