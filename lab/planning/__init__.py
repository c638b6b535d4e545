"""Planning a layout before launch, without torch: the planner and its formulas, meshes, model sizes, stages, communication, recommendations and dry runs."""
