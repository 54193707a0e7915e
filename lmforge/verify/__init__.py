"""The layout certificate of `lmforge plan ... --verify`: the planned layout, scaled down, trained on the
CPU (gloo) and checked against one process, a resume at another world size and the plan's memory.

  toy      toy_run: the scaled layout and the family's model at toy size (what is scaled, kept, refused)
  rank     the per-process program (`python -m lmforge.verify.rank JOB.json`): the trainer, measuring
  certify  verify_layout: launch, compare, print PASS / FAIL per check
"""
