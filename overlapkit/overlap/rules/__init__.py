"""The step rules: what is applied to the gradients around an overlapped step.

Clipping by value and norm (:mod:`~overlapkit.overlap.rules.clipping`), torch's
``clip_grad_norm_`` after a backward that already stepped, answered or refused
(:mod:`~overlapkit.overlap.rules.late_clipping`; its two halves, ``get_total_norm`` and
``clip_grads_with_norm_``: :mod:`~overlapkit.overlap.rules.clip_halves`), an
optimizer's rules once released (:mod:`~overlapkit.overlap.rules.released`), a
``GradScaler``'s unscale and inf
check (:mod:`~overlapkit.overlap.rules.amp_scaler`), and the global step that waits
for the end of backward when a rule needs every gradient
(:mod:`~overlapkit.overlap.rules.global_step`). They build on
:mod:`overlapkit.overlap.core` only.
"""
