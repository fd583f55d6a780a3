"""The quorum service: one interface (``service``), torchft's rule as pure functions
(``rule``), the tree quorum (``tree``), its wire codec (``wire``) and a program's tap (``tap``)."""
