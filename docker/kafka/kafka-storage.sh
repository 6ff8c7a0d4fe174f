#!/bin/sh
# As the official image's script of this name (the compose secure profile formats with it).
exec java -Xmx256m -cp '/opt/kafka/libs/*' kafka.tools.StorageTool "$@"
