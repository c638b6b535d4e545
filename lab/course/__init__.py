"""The course around the notebooks: exercises with blanks and hidden solutions, and the static book."""
