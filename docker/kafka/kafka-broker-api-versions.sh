#!/bin/sh
# As the official image's script of this name: asks the broker for its API versions (the
# compose health checks run it).
exec java -Xmx64m -cp '/opt/kafka/libs/*' org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
