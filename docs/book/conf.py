"""Sphinx settings of the course's book (``make book``): the lessons and solutions executed against the embedded
server, with their outputs and plots; the exercises as a learner gets them.  ``llmlab.ops.book`` stages the
sources next to this file and runs Sphinx with warnings as errors, so a link to a page that does not exist
fails the build."""

project = "llmlab: distributed LLM inference with vLLM"
author = "the llmlab authors"
root_doc = "index"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

html_theme = "sphinx_book_theme"
html_title = "llmlab"
html_theme_options = {"show_toc_level": 2, "use_download_button": True}

# Every lesson and solution runs top to bottom, as in CI; an error in a cell fails the book.  The exercises are
# shown as the learner gets them: not run (their answers are still to be written).
nb_execution_mode = "force"
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_excludepatterns = ["exercises/*"]
nb_merge_streams = True
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # lessons jump from a title to ### exercises: a style, not a fault
