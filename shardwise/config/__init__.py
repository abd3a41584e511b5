"""The config: its schema and value types, presets' files, the device and process-group start-up, and
what commands write where users keep files. The bottom layer: imports no other stage."""
