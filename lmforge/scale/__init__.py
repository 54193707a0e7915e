"""Scaling laws from lmforge's own runs (`lmforge scale`).

  law   Law (L = E + A / N^alpha + B / D^beta), Fit (a FIT.json: predictions with intervals, the
        compute-optimal N and D); standard library only, read by `lmforge plan --loss`
  fit   fit_law: Hoffmann et al.'s approach 3 (Huber on log L, L-BFGS from a grid) + bootstrap (numpy, scipy)
  grid  isoflop_grid: models of a preset's family at compute budgets, as listed sweep trials
  runs  (N, D, L) of finished run folders
  plot  the IsoFLOP plot of a fit
  cli   scale_main(argv) (`lmforge scale sweep | fit`)
"""
