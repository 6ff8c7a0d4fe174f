#!/bin/sh
# As the official image's script of this name: the broker on the given server.properties.
[ -f /opt/kafka/config/log4j2.properties ] || printf '%s\n' 'rootLogger.level = INFO' \
  'rootLogger.appenderRef.stdout.ref = STDOUT' 'appender.stdout.type = Console' \
  'appender.stdout.name = STDOUT' 'appender.stdout.layout.type = PatternLayout' \
  'appender.stdout.layout.pattern = [%d] %p %m (%c)%n' >/opt/kafka/config/log4j2.properties
exec java ${KAFKA_HEAP_OPTS:--Xmx1g -Xms256m} ${KAFKA_OPTS:-} \
  -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp '/opt/kafka/libs/*' kafka.Kafka "$@"
