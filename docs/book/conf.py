"""Sphinx settings of the course's book (``make book``): the lessons and solutions as ``make test`` executed them
against the embedded server, with their outputs and plots; the exercises as a learner gets them.
``llmlab.ops.book`` stages the executed copies next to this file and runs Sphinx with warnings as errors, so a
link to a page that does not exist fails the build."""

project = "llmlab: distributed LLM inference with vLLM"
author = "the llmlab authors"
root_doc = "index"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

html_theme = "sphinx_book_theme"
html_title = "llmlab"
html_theme_options = {"show_toc_level": 2, "use_download_button": True}

# Nothing is executed here: every lesson and solution was executed once, by `make test`, and llmlab.ops.book
# stages those copies (refusing a failed, stale or missing one).  The exercises are shown as the learner gets
# them: not run (their answers are still to be written).
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # lessons jump from a title to ### exercises: a style, not a fault
