"""The keeper side: code that runs in a keeper's process, which outlives the controllers of a
run and hands it to a new one each time one dies (``harness.keeper.keeper``), its beats to a
standby on another node (``harness.keeper.beats``) and that standby's node
(``harness.keeper.standby_node``)."""
