"""Communication between ranks: point-to-point messages and the process groups of a layout."""
