"""``overlapkit demo``: every technique on the same small model, side by side.

- :mod:`~overlapkit.cli.demo.config`: the settings, checked before any rank starts
  (imports no torch, so ``overlapkit demo --help`` and bad arguments answer at once);
- :mod:`~overlapkit.cli.demo.run`: runs each technique in fresh ranks, then the
  checkpoint save and reload;
- :mod:`~overlapkit.cli.demo.worker`: what each rank runs;
  :mod:`~overlapkit.cli.demo.model`: the model and its synthetic data;
- :mod:`~overlapkit.cli.demo.report`: the closing table, its JSON form;
  :mod:`~overlapkit.cli.demo.figure`: the plot.
"""
