"""The engine core: stepping chosen parts of one real optimizer during backward.

What every overlapped technique shares, whatever the model: the engine
(:mod:`~overlapkit.overlap.core.engine`, the base class plugins subclass, and
:mod:`~overlapkit.overlap.core.generic`, the engine for any ``torch.optim`` optimizer
whose step is per parameter (:mod:`~overlapkit.overlap.core.part_steps` tells at
set-up), with the cheaper :mod:`~overlapkit.overlap.core.direct_step` and
:mod:`~overlapkit.overlap.core.functional_step` calls of ``step()``, whose tensor lists
are kept per subset: :mod:`~overlapkit.overlap.core.tensor_lists`), what is kept per
bucket between backwards (:mod:`~overlapkit.overlap.core.bucket_layout`), which
backward a hook runs in (:mod:`~overlapkit.overlap.core.backward_scope`), where steps
run on an accelerator (:mod:`~overlapkit.overlap.core.side_stream`), and the loop
around the optimizer: one step per iteration
(:mod:`~overlapkit.overlap.core.step_accounting`), the window between backward and
step (:mod:`~overlapkit.overlap.core.window`, the end of a learnt first step:
:mod:`~overlapkit.overlap.core.first_step`, the param groups' settings a step reads:
:mod:`~overlapkit.overlap.core.group_settings`, the loop's reads noticed:
:mod:`~overlapkit.overlap.core.watched_reads`, of the parameters:
:mod:`~overlapkit.overlap.core.watched_params`, their warnings:
:mod:`~overlapkit.overlap.core.read_warnings`, its writes to the optimizer's state:
:mod:`~overlapkit.overlap.core.state_marks`, what changed after a stepping backward:
:mod:`~overlapkit.overlap.core.late_changes`, written through ``.data``:
:mod:`~overlapkit.overlap.core.data_writes`), a second backward through a kept graph
(:mod:`~overlapkit.overlap.core.kept_graph`), a trainer's own loop
(:mod:`~overlapkit.overlap.core.foreign_loop`), the hooks put on the user's model,
copied with it as no-ops (:mod:`~overlapkit.overlap.core.own_hooks`), the step hooks
kept behind the loop's own gradient hooks (:mod:`~overlapkit.overlap.core.hook_order`),
the plain order while the optimizer has step hooks
(:mod:`~overlapkit.overlap.core.step_hooks`, a ``step`` patched on the instance:
:mod:`~overlapkit.overlap.core.step_patches`), the state's entries in the plain order
(:mod:`~overlapkit.overlap.core.state_order`), an optimizer's own ``zero_grad`` that
keeps zeros (:mod:`~overlapkit.overlap.core.zeroing`), closures refused
(:mod:`~overlapkit.overlap.core.closures`), ``step()`` run eagerly when a compiled
function calls it (:mod:`~overlapkit.overlap.core.eager_steps`), and parameters added
to the real optimizer behind the overlapped one
(:mod:`~overlapkit.overlap.core.groups_behind`), and a loaded state dict of other
param-group sizes (:mod:`~overlapkit.overlap.core.group_sizes`).
It imports nothing else of :mod:`overlapkit.overlap`.
"""
