"""The tools around the course: the command line, SLURM jobs, the environment check, exercises, the tiny model.

They drive the lessons (``llmlab launch`` plans with ``llmlab.memory``; ``llmlab generate`` runs
``llmlab.offline``), so they import them; no lesson imports from here.  README.md beside this file lists them.
"""
